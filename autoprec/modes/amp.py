"""amp_fp16 and amp_bf16: autocast with fp32 master weights; fp16 adds dynamic loss scaling."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from autoprec.modes.base import PrecisionMode, install_fp32_islands, override

SETTLE_TRIES = 24
"""Halvings :meth:`AmpFp16Mode.settle` tries: 2**16 down to 2**-8."""


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
        self.skipped_steps = 0
        self.steps = 0
        self._unscaled = False

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
            gradients = [p.grad for p in parameters if p.grad is not None]
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
    def backward(self, loss: torch.Tensor) -> None:
        self._require_scaler().scale(loss).backward()

    @override
    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._unscaled:
            self._require_scaler().unscale_(optimizer)
            self._unscaled = True

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        scaler = self._require_scaler()
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        self._unscaled = False
        self.steps += 1
        stepped = scaler.get_scale() >= scale_before  # the scaler backs off only after inf/nan
        if not stepped:
            self.skipped_steps += 1
        return stepped

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
        self.skipped_steps = int(state.get("skipped_steps", 0))
