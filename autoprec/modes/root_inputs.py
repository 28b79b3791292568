"""The model's own fp32 inputs, for the modules a pure-bf16 model keeps in fp32; and whether the
model is still bf16 at all.

Pure bf16 casts the model's fp32 inputs to bf16 at its root (functional code in ``forward``
meets bf16 weights). A kept module handed such an input directly (an observation normaliser
first in the model) would then compute in fp32 from bf16-rounded values: at a mean of 20 the
rounding step is 0.125, at 2020 it is 8. The root's cast records each original here, by the
bf16 tensor it made, for the length of the forward call; a kept module's fp32 island looks its
inputs up and takes the originals, or the same view of one (a slice, a column, a reshape).
Anything computed from an input (a sum, a product) is a new tensor, not found, and cast up from
bf16 as before.

Every cast first asks whether the model still holds bf16 weights (:func:`holds_bf16`, by one
parameter the mode cast, its ``witness``): a copy made fp32 again, as an fp32 weight average
is (``AveragedModel(plan.model).float()``), carries the hooks but must not cast its inputs or
its kept modules' outputs to bf16 (it failed with "mat1 and mat2 must have the same dtype").

The record is per thread and not kept on the model, so a deep copy of ``plan.model`` (whose
hooks are copied with it) finds the inputs of its own calls. Each cast input's original is also
kept for as long as that input lives (weakly keyed by it): activation checkpointing recomputes
a kept module in the backward pass, after the call's record is gone, and without it recomputed
from the bf16-rounded input (found by a hunt: a checkpointed body under bf16_pure got gradients
78% off the same model's without checkpointing).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from autoprec.modes.islands import EagerHook, cast_floats

_calls = threading.local()
"""``.stack``: one record per forward call of the model in progress."""
_alive: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
"""bf16 input -> (its fp32 original, its version counter when made), while the input lives:
for a recompute outside the call (activation checkpointing's backward)."""


class _Call(NamedTuple):
    narrow: bool
    """The model held bf16 weights when the call began, so its inputs were cast."""
    originals: dict[int, tuple[torch.Tensor, torch.Tensor, int | None]]
    """id(bf16 input) -> (the bf16 input, its fp32 original, the bf16 input's version counter
    when it was made: a forward that edits its input in place moves it, and the original no
    longer holds the values the model computes with; None under ``torch.inference_mode``,
    whose tensors keep no counter)."""


def _stack() -> list[_Call]:
    if not hasattr(_calls, "stack"):
        _calls.stack = []
    return _calls.stack


def holds_bf16(module: nn.Module, witness: str | None) -> bool:
    """Does ``module`` still hold its parameter ``witness`` in bf16 (None: no witness, yes)?
    A layer's own parameter is looked up directly: this runs before every bf16 layer."""
    if witness is None:
        return True
    if "." in witness:
        return module.get_parameter(witness).dtype == torch.bfloat16
    parameter = module._parameters.get(witness)
    return parameter is None or parameter.dtype == torch.bfloat16


class InputsToBf16:
    """Forward pre-hook: a module's fp32 inputs to bf16 while it holds ``witness`` in bf16.
    A plain cast, which ``torch.compile`` traces."""

    def __init__(self, witness: str | None) -> None:
        self.witness = witness

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if not holds_bf16(module, self.witness):
            return None
        fp32 = (torch.float32,)
        return cast_floats(args, fp32, torch.bfloat16), cast_floats(kwargs, fp32, torch.bfloat16)


class RootCast:
    """The model's hooks: its fp32 inputs to bf16, each original recorded (while the model
    holds ``witness`` in bf16); the record dropped when the call ends (also when it raises)."""

    def __init__(self, witness: str | None) -> None:
        self.witness = witness

    def cast(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        originals: dict[int, tuple[torch.Tensor, torch.Tensor, int | None]] = {}
        narrow = holds_bf16(module, self.witness)
        _stack().append(_Call(narrow, originals))
        if not narrow:
            return None

        def cast(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                low = value.to(torch.bfloat16)
                version = None if low.is_inference() else low._version
                originals[id(low)] = (low, value, version)
                _alive[low] = (value, version)
                return low
            return value

        return tree_map(cast, args), tree_map(cast, kwargs)

    def forget(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        stack = _stack()
        if stack:
            stack.pop()


def original_input(value: Any) -> Any:
    """The fp32 original of a model input the root cast to bf16, or the same view of it (a
    slice, a column, a reshape of the input); anything else as it is, and so is an input the
    forward edited in place since the cast (``x[:, 0] = 100`` before a kept norm: the original
    no longer holds what the model computes with, and the kept module was handed the unedited
    values)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bfloat16:
        return value
    base = value._base
    for call in reversed(_stack()):
        entry = call.originals.get(id(value))
        if entry is not None and entry[0] is value:
            low, original, version = entry
            return original if _unedited(low, original, version) else value
        entry = None if base is None else call.originals.get(id(base))
        if entry is not None and entry[0] is base:
            low, original, version = entry
            return _same_view(value, low, original) if _unedited(low, original, version) else value
    kept = _alive.get(value)  # outside the call: a checkpointed module's recompute
    if kept is not None:
        return kept[0] if _unedited(value, *kept) else value
    kept = None if base is None else _alive.get(base)
    if kept is not None and base is not None:
        return _same_view(value, base, kept[0]) if _unedited(base, *kept) else value
    return value


def _unedited(low: torch.Tensor, original: torch.Tensor, version: int | None) -> bool:
    """Is the cast input as it was made? By its version counter; under inference mode, which
    keeps none, by its values against the original's cast (a read back to the host, in
    inference only)."""
    if version is not None:
        return low._version == version
    return torch.equal(low, original.to(low.dtype))


def _same_view(view: torch.Tensor, low: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """``view`` of the bf16 cast ``low``, taken of the fp32 ``original`` instead: the same
    elements when the cast kept the original's layout (``.to`` keeps a dense one); else the
    bf16 view as it is."""
    if low.shape != original.shape or low.stride() != original.stride():
        return view
    offset = original.storage_offset() + view.storage_offset() - low.storage_offset()
    return original.as_strided(view.shape, view.stride(), offset)


def in_narrow_call() -> bool:
    """Is the innermost forward call of the model in progress a bf16 one (True outside any)?"""
    stack = _stack()
    return stack[-1].narrow if stack else True


def install_root_cast(model: nn.Module, witness: str | None) -> None:
    """Cast the model's fp32 inputs to bf16, keeping the originals for kept modules. The
    hooks run eagerly under ``torch.compile(plan.model)`` (the record is Python state, keyed
    by tensor identity, which a traced graph would not keep), as the islands' hooks do."""
    root = RootCast(witness)
    model.register_forward_pre_hook(EagerHook(root.cast), with_kwargs=True)
    model.register_forward_hook(EagerHook(root.forget), always_call=True)
