"""tf32: fp32 weights and math, with TF32 tensor-core matmuls and convolutions (Ampere+)."""

from __future__ import annotations

import contextlib

import torch

from autoprec.modes.base import (
    BackwardRunner,
    PrecisionMode,
    float32_matmul_precision,
    override,
    tensor_backward,
)


class Tf32Mode(PrecisionMode):
    """TF32 is switched on only inside ``plan.autocast()`` and ``plan.backward()``."""

    name = "tf32"

    @override
    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        return float32_matmul_precision(tf32=True)

    @override
    def backward(self, loss: torch.Tensor, run: BackwardRunner = tensor_backward) -> None:
        with float32_matmul_precision(tf32=True):
            run(loss)
