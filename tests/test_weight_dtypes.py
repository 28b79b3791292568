from __future__ import annotations

import torch
from torch import nn

from autoprec.weight_dtypes import non_fp32_weights


def test_an_fp32_model_passes() -> None:
    assert non_fp32_weights(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))) is None


def test_each_dtype_is_named_with_its_share_of_tensors_and_values() -> None:
    model = nn.Sequential(nn.Linear(40, 50), nn.Linear(50, 2))
    model[0].to(torch.bfloat16)
    found = non_fp32_weights(model)
    assert found == "torch.bfloat16 in 2 of 4 trainable tensors (2.0k of 2.2k values)"
    model[1].half()
    found = non_fp32_weights(model)
    assert found is not None and found.startswith("torch.bfloat16 in 2 of 4")
    assert "torch.float16 in 2 of 4 trainable tensors (102 of 2.2k values)" in found


def test_a_shared_weight_counts_once_and_frozen_weights_and_buffers_not_at_all() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.Linear(10, 3))
    model[1].weight = model[0].weight  # tied
    model.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    model[2].to(torch.bfloat16).requires_grad_(False)  # a frozen base, as in a LoRA fine-tune
    assert non_fp32_weights(model) is None
    model[0].to(torch.float64)
    assert non_fp32_weights(model) == "torch.float64 in 1 of 1 trainable tensors (40 of 40 values)"
