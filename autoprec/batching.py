"""Batches in, loss and outputs out: the conventions a trial uses to run any model.

Batches may be tensors, tuples/lists or dicts (nested structures are moved to the device as a
whole). The loss comes from, in order: a custom ``train_step(plan, batch) -> loss``; a
``loss_fn``; or the model's own output when it is a scalar, has ``.loss`` or a ``"loss"`` key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from autoprec.plan import PrecisionPlan

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target) -> loss``; see :func:`forward_and_loss` for what target is."""
TrainStep = Callable[[PrecisionPlan, Any], torch.Tensor]
"""``train_step(plan, batch) -> loss``: runs the forward pass itself, inside
``plan.autocast()``."""


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in the batch to ``device``."""
    return tree_map(
        lambda value: (
            value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        ),
        batch,
    )


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, torch.Tensor)]


def count_samples(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    tensors = [t for t in _tensors(batch) if t.dim() > 0]
    if not tensors:
        raise ValueError(
            f"A batch must contain at least one tensor with a batch dimension; got "
            f"{type(batch).__name__}."
        )
    return int(tensors[0].shape[0])


def count_tokens(batch: Any) -> int | None:
    """Tokens in a batch: the size of its first integer tensor of shape (batch, sequence)."""
    for tensor in _tensors(batch):
        if tensor.dim() == 2 and not tensor.is_floating_point() and tensor.dtype != torch.bool:
            return int(tensor.numel())
    return None


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


def _loss_from_output(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None


def prediction(output: Any) -> torch.Tensor | None:
    """The model's prediction for output agreement: a non-scalar tensor, ``.logits``, a
    ``"logits"`` key, or the first non-scalar tensor of a tuple; None when it only gave a loss."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() > 0 else None
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, tuple | list):
        return next((t for t in output if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    return None


def _scalar(loss: Any, source: str) -> torch.Tensor:
    """``loss`` when it is one number; else a ValueError saying what ``source`` returned."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    found = (
        f"a tensor of shape {tuple(loss.shape)}"
        if isinstance(loss, torch.Tensor)
        else type(loss).__name__
    )
    raise ValueError(
        f"{source} returned {found}, not a scalar loss: reduce it to one number (e.g. "
        "reduction='mean' in a torch.nn loss, or .mean())."
    )


def forward_and_loss(
    plan: PrecisionPlan,
    batch: Any,
    loss_fn: LossFn | None = None,
    train_step: TrainStep | None = None,
) -> tuple[torch.Tensor, Any]:
    """Run one forward pass (call inside ``plan.autocast()``); returns (loss, model output).

    With ``loss_fn``: a tuple/list batch is ``(*inputs, target)`` and the loss is
    ``loss_fn(model(*inputs), target)``; a dict or tensor batch is passed whole to the model and
    the loss is ``loss_fn(output, batch)``.
    """
    if train_step is not None:
        return _scalar(train_step(plan, batch), "train_step(plan, batch)"), None
    if loss_fn is not None:
        if isinstance(batch, tuple | list) and len(batch) >= 2:
            output = _call(plan.model, tuple(batch[:-1]))
            return _scalar(loss_fn(output, batch[-1]), "loss_fn(output, target)"), output
        output = _call(plan.model, batch)
        return _scalar(loss_fn(output, batch), "loss_fn(output, batch)"), output
    output = _call(plan.model, batch)
    loss = _loss_from_output(output)
    if loss is None:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else None
        found = f"Tensor of shape {shape}" if shape is not None else type(output).__name__
        raise ValueError(
            f"Cannot find a loss: the model returned {found}. Pass loss_fn(output, target) or "
            "train_step(plan, batch), or make the model return a scalar loss, .loss or "
            '["loss"].'
        )
    return loss, output
