"""Which floating dtypes a model's trainable weights are in: every mode starts from fp32.

A model loaded in bf16 (``from_pretrained(..., torch_dtype=torch.bfloat16)``, Lightning's
``bf16-true``) trains as it is under every mode's name: its "fp32" reference and its AMP modes
would be pure bf16 with nearest rounding, the failure autoprec exists to catch. ``tune()``,
``check()`` and ``apply()`` therefore refuse such a model and say how to pass it in fp32.
Frozen weights (``requires_grad=False``: a LoRA fine-tune's bf16 base) are never updated, so
no rounding of updates applies to them: they may stay in the dtype you load them in.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn


def as_real(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real view (``torch.view_as_real``: its real and imaginary parts
    as a last dimension of 2), the way torch's optimizers update it; any other tensor as it is.
    ``.float()`` of a complex tensor would drop the imaginary parts (with a warning)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def is_floating(tensor: torch.Tensor) -> bool:
    """A real floating or complex tensor (one a precision mode may cast)."""
    return tensor.is_floating_point() or tensor.is_complex()


def same_values(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Same shape, dtype and values, NaN equal to NaN."""
    if first.shape != second.shape or first.dtype != second.dtype:
        return False
    if is_floating(first):
        return bool(torch.allclose(first, second, rtol=0, atol=0, equal_nan=True))
    return torch.equal(first, second)


def stored_values(gradient: torch.Tensor) -> torch.Tensor:
    """The values a gradient stores: a sparse gradient's (``nn.Embedding(sparse=True)``)
    nonzero values, duplicates summed; any other as it is. Norms and maxima over them are the
    dense gradient's, which ``torch._foreach_norm`` cannot take from a sparse tensor."""
    return gradient.coalesce().values() if gradient.is_sparse else gradient


def _trainable_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every floating parameter that trains (``model.parameters()`` yields a shared one once)."""
    return [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]


def _count(values: int) -> str:
    if values >= 1_000_000:
        return f"{values / 1e6:.1f}M"
    if values >= 1_000:
        return f"{values / 1e3:.1f}k"
    return str(values)


def non_fp32_weights(model: nn.Module) -> str | None:
    """What is not fp32 among the model's trainable parameters, in words (e.g.
    ``"torch.bfloat16 in 24 of 26 trainable tensors (5.2M of 5.3M values)"``); None when every
    one is fp32."""
    tensors = _trainable_tensors(model)
    others = [tensor for tensor in tensors if tensor.dtype != torch.float32]
    if not others:
        return None
    by_dtype: Counter[torch.dtype] = Counter()
    values_by_dtype: Counter[torch.dtype] = Counter()
    for tensor in others:
        by_dtype[tensor.dtype] += 1
        values_by_dtype[tensor.dtype] += tensor.numel()
    total_values = sum(tensor.numel() for tensor in tensors)
    parts = [
        f"{dtype} in {count} of {len(tensors)} trainable tensors "
        f"({_count(values_by_dtype[dtype])} of {_count(total_values)} values)"
        for dtype, count in by_dtype.most_common()
    ]
    return "; ".join(parts)


FP32_FIX = (
    "Pass it in fp32: model.float() (Hugging Face: from_pretrained(..., "
    "torch_dtype=torch.float32)); bf16 and fp16 values convert to fp32 exactly, and each mode "
    "casts what it needs (the pure-bf16 modes to bf16)."
)
"""How to pass a model in fp32: the end of every refusal of a half-precision model."""

FP64_FIX = (
    "float64 is wider than every mode autoprec judges: fp32 is its widest and its reference, so "
    "it cannot tell whether fp32 is enough for this model, and model.float() rounds float64 "
    "values. If fp32 is enough (check by training in fp32 against your float64 run), pass "
    "model.float(); if the model needs float64 (ill-conditioned physics, high-order "
    "derivatives), keep float64 without autoprec."
)
"""How to answer a float64 model (scientific ML, physics-informed nets; found by a hunt: it
was refused with the bf16 advice, "bf16 and fp16 values convert to fp32 exactly")."""


def fp32_fix(model: nn.Module) -> str:
    """The advice that ends a refusal of ``model``'s non-fp32 weights: float64's when any
    trainable tensor is float64, else the half-precision one."""
    wider = any(tensor.dtype == torch.float64 for tensor in _trainable_tensors(model))
    return FP64_FIX if wider else FP32_FIX
