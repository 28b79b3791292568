"""An autocast the user's code enters around the model: found while a forward runs.

The model's own ``forward`` entering ``torch.autocast``, or a ``train_step`` calling
``plan.model`` (or one of its submodules) inside its own, sets the dtype of every run autoprec
makes, the fp32 reference's too: each mode is then compared with that dtype, not with fp32
(amp_bf16 under an fp16 one read "safe, forward cost +0.00%", the reference compared with
itself; found by a hunt replaying ../shared/seeds' diffusion story). A forward pre-hook on the
model's compute layers missed an autocast around ``nn.MultiheadAttention``, a raw
``x @ self.w`` or a Linear subclass's own forward, and a ``train_step``'s around a submodule
call or a second call (a review): the watch reads the autocast state at every torch call
made inside any of the model's modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_DEVICE_TYPES = ("cpu", "cuda")


def lowering_autocast(device_type: str) -> str | None:
    """``"bfloat16 autocast on cpu"`` when an autocast that lowers precision is on for
    ``device_type``; None when none is (or its dtype is fp32, which on CUDA torch keeps on: a
    block keeping a part in fp32, as ``enabled=False`` does; a review)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        dtype = torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know: meta (the scan of a model there)
        return None
    if dtype == torch.float32:
        return None
    return f"{str(dtype).removeprefix('torch.')} autocast on {device_type}"


class OwnAutocastWatch(TorchFunctionMode):
    """Within the block: ``around``, a lowering autocast already on where a call into one of
    ``model``'s modules began from outside them (a ``train_step``'s around ``plan.model`` or
    a submodule); ``found``, the first lowering autocast seen at a torch call made inside one
    of them (``"bfloat16 autocast on cpu at blocks.0.attn"``), the forward's own included.
    Neither counts one already on where the block began (the caller's, which tune and check
    lift first). None: none. Every device type the model's tensors are on is read (a model
    spread over the CPU and a GPU: a review)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        tensors = [*model.parameters(), *model.buffers()]
        self.device_types = sorted({t.device.type for t in tensors}) or ["cpu"]
        self.around: str | None = None
        self.found: str | None = None
        self._outer = any(lowering_autocast(d) for d in self.device_types)
        self._inside: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> OwnAutocastWatch:
        for name, module in self.model.named_modules():

            def push(_module: nn.Module, _args: Any, name: str = name) -> None:
                if not self._inside and self.around is None:  # a call from outside the model
                    self.around = self._lowering(name)
                self._inside.append(name)

            def pop(_module: nn.Module, _args: Any, _output: Any) -> None:
                if self._inside:
                    self._inside.pop()

            self._handles.append(module.register_forward_pre_hook(push))
            self._handles.append(module.register_forward_hook(pop, always_call=True))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.found is None and self._inside:  # a module with no torch call lowers nothing
            self.found = self._lowering(self._inside[-1])
        return func(*args, **(kwargs or {}))

    def _lowering(self, name: str) -> str | None:
        if self._outer:
            return None
        found = next(filter(None, map(lowering_autocast, self.device_types)), None)
        return None if found is None else f"{found} at {name or 'the model'}"


@contextlib.contextmanager
def autocast_state_kept() -> Iterator[None]:
    """Every device type's autocast switch and dtype as they were after the block: a
    ``train_step`` stopped between its ``torch.set_autocast_enabled(True)`` and its reset left
    autocast on in the caller's process (a review), and a forward that raises between a mode's
    two island hooks (autocast entered in one, left in the other) left autocast on for every
    later run, the fp32 reference's included. Seen on the first GPU run (H100, torch 2.11):
    after compiled pure-bf16 trials failed in those hooks, tune()'s fp32 reference timed 1571
    samples/s, amp_bf16's speed, where fp32 runs 460."""
    kept = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _DEVICE_TYPES]
    try:
        yield
    finally:
        for device_type, enabled, dtype in kept:
            torch.set_autocast_enabled(device_type, enabled)
            torch.set_autocast_dtype(device_type, dtype)
