"""The model's own fp32 inputs, for the modules a pure-bf16 model keeps in fp32.

Pure bf16 casts the model's fp32 inputs to bf16 at its root (functional code in ``forward``
meets bf16 weights). A kept module handed such an input directly (an observation normaliser
first in the model) would then compute in fp32 from bf16-rounded values: at a mean of 20 the
rounding step is 0.125, at 2020 it is 8. The root's cast records each original here, by the
bf16 tensor it made, for the length of the forward call; a kept module's fp32 island looks its
inputs up and takes the originals. Anything computed from an input (a view, a sum) is a new
tensor, not found, and cast up from bf16 as before.

The record is per thread and not kept on the model, so a deep copy of ``plan.model`` (whose
hooks are shared functions) finds the inputs of its own calls.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

_calls = threading.local()
"""``.stack``: one dict per forward call in progress, id(bf16 input) -> (bf16, fp32 original)."""


def _stack() -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    if not hasattr(_calls, "stack"):
        _calls.stack = []
    return _calls.stack


def cast_root_inputs(_module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Forward pre-hook of the model: its fp32 inputs to bf16, each original recorded."""
    originals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
            low = value.to(torch.bfloat16)
            originals[id(low)] = (low, value)
            return low
        return value

    _stack().append(originals)
    return tree_map(cast, args), tree_map(cast, kwargs)


def forget_root_inputs(_module: nn.Module, _args: Any, _output: Any) -> None:
    """Forward hook of the model (also called when forward raises): drop this call's record."""
    stack = _stack()
    if stack:
        stack.pop()


def original_input(value: Any) -> Any:
    """The fp32 original of a model input the root cast to bf16; anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bfloat16:
        return value
    for originals in reversed(_stack()):
        entry = originals.get(id(value))
        if entry is not None and entry[0] is value:
            return entry[1]
    return value


def install_root_cast(model: nn.Module) -> None:
    """Cast the model's fp32 inputs to bf16, keeping the originals for kept modules. The
    hooks run eagerly under ``torch.compile(plan.model)`` (the record is Python state, keyed
    by tensor identity, which a traced graph would not keep), as the islands' hooks do."""
    model.register_forward_pre_hook(torch.compiler.disable(cast_root_inputs), with_kwargs=True)
    model.register_forward_hook(torch.compiler.disable(forget_root_inputs), always_call=True)
