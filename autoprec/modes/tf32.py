"""tf32: fp32 weights and math, with TF32 tensor-core matmuls and convolutions (Ampere+)."""

from __future__ import annotations

import contextlib

import torch

from autoprec.modes.base import PrecisionMode, float32_matmul_precision, override


class Tf32Mode(PrecisionMode):
    """TF32 is switched on only inside ``plan.autocast()`` and ``plan.backward()``."""

    name = "tf32"

    @override
    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        return float32_matmul_precision(tf32=True)

    @override
    def backward(self, loss: torch.Tensor) -> None:
        with float32_matmul_precision(tf32=True):
            loss.backward()
