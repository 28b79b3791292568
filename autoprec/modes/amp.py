"""amp_fp16 and amp_bf16: autocast with fp32 master weights; fp16 adds dynamic loss scaling."""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from autoprec.modes.base import BackwardRunner, PrecisionMode, override, tensor_backward
from autoprec.modes.islands import install_fp32_islands
from autoprec.weight_dtypes import stored_values

SETTLE_TRIES = 24
"""Halvings :meth:`AmpFp16Mode.settle` tries: 2**16 down to 2**-8."""


def _stepping(optimizer: torch.optim.Optimizer, run: Callable[[], object]) -> bool:
    """Run ``run`` and say whether it called ``optimizer.step`` (found by wrapping it for the
    call: nothing is read from the device)."""
    called: list[bool] = []
    own = vars(optimizer).get("step")  # an instance-level wrapper (schedulers set one)
    inner = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        called.append(True)
        return inner(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]
    try:
        run()
    finally:
        if own is None:
            del optimizer.step
        else:
            optimizer.step = own  # type: ignore[method-assign]
    return bool(called)


class AmpBf16Mode(PrecisionMode):
    """Autocast to bf16; ``keep_fp32`` modules run with autocast off."""

    name = "amp_bf16"
    dtype: ClassVar[torch.dtype] = torch.bfloat16

    @override
    def convert_module(self, model: nn.Module) -> nn.Module:
        model = super().convert_module(model)
        install_fp32_islands(model, self.kept_roots(model), self.device_type)
        return model

    @override
    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        return torch.autocast(self.device_type, dtype=self.dtype)


class AmpFp16Mode(AmpBf16Mode):
    """Autocast to fp16 with torch's GradScaler (dynamic loss scaling)."""

    name = "amp_fp16"
    dtype = torch.float16

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scaler: torch.amp.GradScaler | None = None
        self.steps = 0
        self._unscaled = False
        self._skipped: torch.Tensor | None = None  # on the device: counting costs no host read
        self._skipped_before = 0  # restored from a checkpoint

    @property
    @override
    def skipped_steps(self) -> int:
        """Optimizer steps the loss scaler skipped (reading it is a host read)."""
        counted = 0 if self._skipped is None else int(self._skipped.item())
        return self._skipped_before + counted

    @override
    def convert_module(self, model: nn.Module) -> nn.Module:
        model = super().convert_module(model)
        self.scaler = torch.amp.GradScaler(self.device_type)
        return model

    @override
    def settle(self, compute_loss: Callable[[], torch.Tensor], model: nn.Module) -> None:
        """Halve the loss scale until one backward pass of ``compute_loss`` has finite
        gradients: the start-up skips GradScaler makes from 2**16 are calibration, not drift."""
        scaler = self._require_scaler()
        parameters = [p for p in model.parameters() if p.requires_grad]
        for _ in range(SETTLE_TRIES):
            scaler.scale(compute_loss()).backward()
            gradients = [stored_values(p.grad) for p in parameters if p.grad is not None]
            finite = not gradients or bool(
                torch.stack(torch._foreach_norm(gradients)).isfinite().all()
            )
            for parameter in parameters:
                parameter.grad = None
            if finite:
                return
            scaler.update(scaler.get_scale() / 2)

    def _require_scaler(self) -> torch.amp.GradScaler:
        if self.scaler is None:
            raise RuntimeError("amp_fp16 is not prepared: call plan.prepare / profile.apply.")
        return self.scaler

    @override
    def backward(self, loss: torch.Tensor, run: BackwardRunner = tensor_backward) -> None:
        run(self._require_scaler().scale(loss))

    @override
    def discard_accumulated(self) -> None:
        """The optimizer's ``zero_grad`` dropped the step's gradients: the next unscale is of
        new ones. A loop that measured the norm (``plan.clip_gradients``), dropped a spiking
        step with ``zero_grad`` and went on stepped on gradients never unscaled, 1024x too
        large at a scale of 1024, and the stale inf flag let an overflow through (found by a
        hunt; torch's second ``unscale_`` raises there)."""
        if self._unscaled and self.scaler is not None:
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            states = collections.defaultdict(_refresh_per_optimizer_state)
            self.scaler._per_optimizer_states = states
        self._unscaled = False

    @override
    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._unscaled:
            self._require_scaler().unscale_(optimizer)
            self._unscaled = True

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """GradScaler's step and update, with no host read of autoprec's own: whether the
        step was taken is whether GradScaler called ``optimizer.step`` (it reads the inf flags
        itself, as in any loop using it; a fused optimizer takes them on the device and is
        always called, so this returns True). ``skipped_steps`` counts exactly on the device."""
        scaler = self._require_scaler()
        self.unscale_gradients(optimizer)  # what scaler.step would do first: the inf check
        per_device = scaler._found_inf_per_device(optimizer)
        if not per_device:  # no weight got a gradient: nothing to step, nothing to check
            # (a bare AssertionError before; the other modes step nothing and return True;
            # found by a hunt). The scaler forgets this step's unscale, as update() would.
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)
            self._unscaled = False
            self.steps += 1
            return True
        found = _combined_inf_flags(per_device.values(), scaler._get_scale_async().device)
        self._skipped = found.clone() if self._skipped is None else self._skipped + found
        stepped = _stepping(optimizer, lambda: scaler.step(optimizer))
        scaler.update()
        self._unscaled = False
        self.steps += 1
        return stepped

    @override
    def loss_scale_tensor(self) -> torch.Tensor | None:
        return self._require_scaler()._get_scale_async()

    @property
    def loss_scale(self) -> float:
        return self._require_scaler().get_scale()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "scaler": self._require_scaler().state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._require_scaler().load_state_dict(state["scaler"])
        self.steps = int(state.get("steps", 0))
        self._skipped_before, self._skipped = int(state.get("skipped_steps", 0)), None


def _combined_inf_flags(flags: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The step's inf flags summed on the scale's device, each moved there first without a
    host read, as GradScaler combines them: a model split over GPUs has one flag a device, and
    adding a cuda:0 tensor to a cuda:1 one raises (found by a review of the CUDA paths)."""
    moved = [flag.to(device, non_blocking=True) for flag in flags]
    return functools.reduce(operator.add, moved[1:], moved[0])
