"""Batches in, loss and outputs out: the conventions a trial uses to run any model.

Batches may be tensors, tuples/lists, dicts or other mappings (a Hugging Face collator's
``BatchEncoding``), and dataclass instances (for a ``train_step``); nested structures are moved
to the device as a whole. The loss comes from,
in order: a custom ``train_step(plan, batch) -> loss``; a ``loss_fn``; or the model's own
output when it is a scalar, has ``.loss`` or a ``"loss"`` key.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from autoprec.errors import BatchError, LossError
from autoprec.layer_flops import ModelCall, call_model
from autoprec.own_autocast import OwnAutocastWatch, autocast_state_kept
from autoprec.plan import PrecisionPlan
from autoprec.weight_dtypes import same_values

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target) -> loss``; see :func:`forward_and_loss` for what target is."""
TrainStep = Callable[[PrecisionPlan, Any], torch.Tensor]
"""``train_step(plan, batch) -> loss``: runs the forward pass itself, inside
``plan.autocast()``."""
EvalFn = Callable[[nn.Module], float | torch.Tensor]
"""``eval_fn(model) -> score`` (lower is better): a number or a one-element tensor."""


def _foreign_mapping(value: Any) -> bool:
    """A mapping torch's pytree does not open (Hugging Face's ``BatchEncoding``, a
    ``UserDict``): it would be one opaque leaf."""
    return isinstance(value, Mapping) and not isinstance(value, dict)


def _dataclass_instance(value: Any) -> bool:
    """A dataclass instance (a batch a ``train_step`` reads as ``batch.x``): pytree would
    leave it one opaque leaf."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _opaque(value: Any) -> bool:
    return _foreign_mapping(value) or _dataclass_instance(value)


def _rebuilt_dataclass(original: Any, values: dict[str, Any], keep_types: bool) -> Any:
    """A shallow copy of the dataclass ``original`` holding ``values`` in its fields (frozen
    ones too), or the plain dict of them (``keep_types=False``)."""
    if not keep_types:
        return values
    rebuilt = copy.copy(original)
    for name, value in values.items():
        object.__setattr__(rebuilt, name, value)
    return rebuilt


def _rebuilt(original: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """``values`` in the mapping type of ``original``: ``original`` itself when no value
    changed, else built from a dict (``BatchEncoding``, ``UserDict``) or a copy with the items
    set. A class that takes neither is refused: it became a plain dict, and a ``train_step``
    reading ``batch.x`` failed with "'dict' object has no attribute 'x'", blamed on the
    batches (found by a hunt)."""
    if all(values[key] is original[key] for key in values):
        return original
    try:
        return type(original)(values)
    except Exception:  # noqa: BLE001 - a class that cannot be rebuilt from a dict
        pass
    try:
        rebuilt = copy.copy(original)
        for key, value in values.items():
            rebuilt[key] = value  # type: ignore[index]
        return rebuilt
    except Exception as error:  # named in the refusal
        raise BatchError(
            f"A batch of type {type(original).__name__} (a Mapping) cannot be rebuilt with "
            "new tensors (copied, or moved to the device): its class takes no dict and its "
            f"copy takes no item assignment ({type(error).__name__}: {error}). Give it a "
            "constructor that takes a dict, or have the loader yield dicts or dataclasses."
        ) from error


def map_tensors(
    function: Callable[[torch.Tensor], Any], batch: Any, *, keep_types: bool = True
) -> Any:
    """``batch`` with ``function`` applied to every tensor in it, through tuples, lists,
    dicts, any other mapping (a Hugging Face collator's ``BatchEncoding``) and dataclass
    instances, each kept in its own type (``keep_types=False``: such mappings and dataclasses
    become dicts)."""

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return function(value)
        if _foreign_mapping(value):
            mapped = {
                key: map_tensors(function, item, keep_types=keep_types)
                for key, item in value.items()
            }
            return _rebuilt(value, mapped) if keep_types else mapped
        if _dataclass_instance(value):
            fields = {
                field.name: map_tensors(function, getattr(value, field.name), keep_types=keep_types)
                for field in dataclasses.fields(value)
            }
            return _rebuilt_dataclass(value, fields, keep_types)
        return value

    return tree_map(visit, batch, is_leaf=_opaque)


def as_plain(batch: Any) -> Any:
    """``batch`` with every mapping pytree does not open turned into a dict, so a digest of
    it reads every tensor (a ``BatchEncoding``'s repr elides them)."""
    return map_tensors(lambda tensor: tensor, batch, keep_types=False)


def fresh_copy(batch: Any) -> Any:
    """A copy of ``batch`` whose tensors and containers are new (what a loader hands a step)."""
    return map_tensors(torch.clone, batch)


def _same_leaf(first: Any, second: Any) -> bool:
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        return same_values(first, second)
    try:
        return bool(first == second)
    except Exception:  # noqa: BLE001 - a leaf without a usable ==: not ours to judge
        return True


def same_batch(first: Any, second: Any) -> bool:
    """Whether two batches hold the same structure and values (NaN equal to NaN)."""
    first_leaves, first_spec = tree_flatten(as_plain(first))
    second_leaves, second_spec = tree_flatten(as_plain(second))
    return first_spec == second_spec and all(
        _same_leaf(a, b) for a, b in zip(first_leaves, second_leaves, strict=True)
    )


class FreshBatches(Sequence[Any]):
    """``batches`` handing out a fresh copy of a batch at every read: for a model (or loss)
    that changes its input batch in place, so every run and step sees the loader's data."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [fresh_copy(batch) for batch in self.batches[index]]
        return fresh_copy(self.batches[index])


class WatchedBatches(FreshBatches):
    """:class:`FreshBatches` that keeps the first ``keep`` copies it hands out beside their
    originals, to tell afterwards whether the run changed its input batches in place."""

    def __init__(self, batches: Sequence[Any], keep: int = 2) -> None:
        super().__init__(batches)
        self.keep = keep
        self.handed: list[tuple[Any, Any]] = []

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        copy = super().__getitem__(index)
        if isinstance(index, int) and len(self.handed) < self.keep:
            self.handed.append((self.batches[index], copy))
        return copy

    def changed(self) -> bool:
        """Whether a watched copy no longer equals its original."""
        return not all(same_batch(copy, original) for original, copy in self.handed)


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in the batch to ``device``."""
    return map_tensors(lambda tensor: tensor.to(device, non_blocking=True), batch)


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """Every tensor in ``batch`` (or a module's output), through the containers
    :func:`map_tensors` opens."""
    leaves = tree_flatten(as_plain(batch))[0]
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


MAIN_INPUT_RANKS = {
    "input_ids": 2, "pixel_values": 4, "input_values": 2, "input_features": 3,
    "inputs_embeds": 3,
}  # fmt: skip
"""Keys a Hugging Face batch holds its model's main input under (samples and tokens are
counted from it where a batch has one), and the dimensions it has in a batch: one fewer is a
single sample's (``input_ids`` of shape (T,))."""


def main_input(plain: Any) -> tuple[str, torch.Tensor] | None:
    """The key and tensor a mapping batch (``as_plain``) holds its main input under
    (``MAIN_INPUT_RANKS``), or None."""
    if isinstance(plain, Mapping):
        for key in MAIN_INPUT_RANKS:
            value = plain.get(key)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return key, value
    return None


def count_batch(batch: Any) -> tuple[int, int | None]:
    """Samples and tokens in a batch (tokens None where it holds no token ids).

    Samples: the leading dimension of its main input (``input_ids``, ...), or else the one
    most of its tensors of two or more dimensions share (a square mask aside), a leading 1 (a
    tensor broadcast over the batch) losing a tie, or else the first tensor's. The first
    tensor's alone counted one sample for a batch led by ``position_ids`` of shape (1, T)
    (found by a hunt); the leading dimension most tensors share counted 128 for
    ``(idx (8, 128), pos (128,), mask (128, 128))``, and passing over every leading 1 counted
    128 for a real batch of one (found by reviews). Tokens: the size of its ``input_ids``,
    or else of its first integer tensor of shape (samples, sequence); padding counts, as the
    step computes on it."""
    plain = as_plain(batch)
    tensors = [leaf for leaf in tree_flatten(plain)[0] if isinstance(leaf, torch.Tensor)]
    leading = [int(tensor.shape[0]) for tensor in tensors if tensor.dim() > 0]
    if not leading:
        raise BatchError(
            f"A batch must contain at least one tensor with a batch dimension, inside "
            f"tuples, lists, mappings or dataclasses (samples/s is counted from them); "
            f"found none in a {type(batch).__name__}. Make the loader yield one of those, "
            "e.g. a dict of tensors (a train_step reads it as batch['x'])."
        )
    found = main_input(plain)
    main = None if found is None else found[1]
    if main is not None:
        samples = int(main.shape[0])
        if main.dim() == 2 and not main.is_floating_point():
            return samples, int(main.numel())
    else:
        samples = _batch_dimension(tensors) or leading[0]
    for tensor in tensors:
        if (
            tensor.dim() == 2
            and not tensor.is_floating_point()
            and tensor.dtype != torch.bool
            and tensor.shape[0] == samples
        ):
            return samples, int(tensor.numel())
    return samples, None


def _batch_dimension(tensors: list[torch.Tensor]) -> int | None:
    """The leading dimension most tensors of two or more dimensions share, square masks
    aside, a leading 1 losing a tie (None without such tensors)."""
    leading = [
        int(t.shape[0])
        for t in tensors
        if t.dim() >= 2 and not (t.dim() == 2 and t.shape[0] == t.shape[1])
    ]
    if not leading:
        return None
    return max(leading, key=lambda n: (leading.count(n), n != 1, -leading.index(n)))


def _loss_from_output(output: Any) -> torch.Tensor | None:
    """The loss the model returned: itself when one number, its ``.loss`` or ``["loss"]``
    (refused, with its shape, when not one number)."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return None if loss is None else _scalar(loss, "the model's output .loss")


def _predicted(value: Any) -> bool:
    """A real-valued tensor with a batch dimension: what output agreement can compare (a
    bool mask, class indices or a complex spectrum has no relative error or argmax). One
    number is not one, whatever its shape: a loss returned as shape (1,) (``loss.unsqueeze(0)``,
    a loss gathered over one device) was compared as the prediction, and chosen over the logits
    after it in a tuple (found by a hunt); the loss is what ``_loss_from_output`` takes it for."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() > 0
        and value.numel() > 1
        and value.is_floating_point()
    )


def prediction(output: Any) -> torch.Tensor | None:
    """The model's prediction for output agreement: a floating non-scalar tensor (the output
    itself, its ``.logits`` / ``"logits"``, else the first one among a tuple's items, a
    mapping's values or a dataclass's fields other than ``loss``); None when there is none
    (the model gave only a loss, or only integer, bool or complex tensors)."""
    if isinstance(output, torch.Tensor):
        return output if _predicted(output) else None
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if _predicted(logits):
        return logits
    if isinstance(output, Mapping):
        items: Any = (value for key, value in output.items() if key != "loss")
    elif _dataclass_instance(output):
        fields = dataclasses.fields(output)
        items = (getattr(output, f.name) for f in fields if f.name != "loss")
    elif isinstance(output, tuple | list):
        items = output
    else:
        return None
    return next((item for item in items if _predicted(item)), None)


def _scalar(loss: Any, source: str) -> torch.Tensor:
    """``loss`` when it is one number; else a LossError saying what ``source`` returned."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    if isinstance(loss, numbers.Number):
        raise LossError(
            f"{source} returned a Python {type(loss).__name__} ({loss!r}), not a loss tensor: "
            "no gradient flows through a number. Return the tensor itself (not loss.item() "
            "or float(loss))."
        )
    if isinstance(loss, tuple | list):
        raise LossError(
            f"{source} returned a {type(loss).__name__} of {len(loss)}, not a scalar loss: "
            "return the loss tensor alone (log the rest from your own loop or a hook)."
        )
    if not isinstance(loss, torch.Tensor):  # None, a dict: "reduce it" did not fit (a hunt)
        keys = f" with keys {sorted(map(str, loss))[:4]}" if isinstance(loss, Mapping) else ""
        raise LossError(
            f"{source} returned {type(loss).__name__}{keys}, not a loss tensor: return the "
            "scalar loss tensor itself (a forgotten return gives None)."
        )
    raise LossError(
        f"{source} returned a tensor of shape {tuple(loss.shape)}, not a scalar loss: reduce "
        "it to one number (e.g. reduction='mean' in a torch.nn loss, or .mean())."
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
            output = call_model(plan.model, tuple(batch[:-1]))
            return _scalar(loss_fn(output, batch[-1]), "loss_fn(output, target)"), output
        output = call_model(plan.model, batch)
        return _scalar(loss_fn(output, batch), "loss_fn(output, batch)"), output
    output = call_model(plan.model, batch)
    loss = _loss_from_output(output)
    if loss is None:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else None
        found = f"Tensor of shape {shape}" if shape is not None else type(output).__name__
        raise LossError(
            f"Cannot find a loss: the model returned {found}. Pass loss_fn(output, target) or "
            "train_step(plan, batch), or make the model return a scalar loss, .loss or "
            '["loss"].'
        )
    return loss, output


def first_model_call(train_step: TrainStep, plan: PrecisionPlan, batch: Any) -> ModelCall | None:
    """The arguments ``train_step(plan, batch)`` first calls ``plan.model`` with outside a
    ``torch.func`` transform, for the probe's scan, from one run of it on the scan's copy.
    None when it raises first or never calls ``plan.model`` itself (then the scan runs without
    a forward, and the fp32 calibration reports the error). Refuses a ``train_step`` that
    runs the model or a submodule inside an autocast of its own, at any call
    (:func:`own_autocast_refusal`): the run goes on past the first call for that (it stopped
    there before, and a second call under an autocast escaped: a review)."""
    calls: list[ModelCall] = []

    def record(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # not a call under torch.vmap or torch.func.hessian (a physics residual per point):
        # its arguments are the transform's wrappers, and the scan's replay of them outside
        # it raised "your tensor may have escaped" (found by a hunt)
        if not calls and torch._C._functorch.maybe_current_level() is None:
            calls.append(ModelCall(tuple(args), dict(kwargs)))

    handle = plan.model.register_forward_pre_hook(record, with_kwargs=True)
    watch = OwnAutocastWatch(plan.model)
    try:  # with gradients: a gradient penalty's autograd.grad or a GAN's own backward ran
        # under no_grad raised, and an autocast after it escaped (a review); the scan's copy
        # and its lr-0 optimizer are thrown away
        with torch.enable_grad(), autocast_state_kept(), watch:
            train_step(plan, batch)
    except Exception:  # noqa: BLE001 - the calibration's fp32 steps report train_step's errors
        pass  # a call caught before it failed still tells the scan how the model is called
    finally:
        handle.remove()
    if watch.around is not None:  # a forward's own is the scan's to refuse, in its words
        raise own_autocast_refusal(watch.around)
    return calls[0] if calls else None


def own_autocast_refusal(found: str) -> ValueError:
    """A ``train_step`` running ``plan.model`` inside its own ``torch.autocast`` (a training
    script's ``with torch.autocast(...)`` kept in it: found by a hunt replaying
    ../shared/seeds' diffusion story). Its autocast overrides each mode's: the "fp32"
    reference, its noise runs and every AMP trial ran in the train_step's dtype, and the report
    still said "against fp32" (amp_bf16 under a train_step's fp16 autocast: "safe, forward
    cost +0.00%", the reference compared with itself). Worded for the trainer integrations'
    users too, who wrote a ``training_step`` or a ``compute_loss``, not a train_step (a
    review)."""
    return ValueError(
        f"Your loss code runs the model inside an autocast of its own ({found}, found in an "
        "fp32 run of it): your train_step, or the LightningModule's training_step or the "
        "Trainer's compute_loss autoprec runs as one. That autocast overrides each mode's "
        "precision, so the fp32 reference and every trial would run in its dtype and each mode "
        "would be compared with it, not with fp32. Take that torch.autocast (or "
        "accelerator.autocast) out: a train_step calls plan.model under `with "
        "plan.autocast():`, which enters each mode's precision, and the trainer integrations "
        "enter it around your training_step / compute_loss themselves."
    )
