"""Modes on a real CUDA GPU. Skipped without one, with the mode's own reasons."""

from __future__ import annotations

import pytest
import torch

import autoprec
from autoprec.eligibility import situation_for_model
from autoprec.modes import mode_for
from autoprec.specs import ModeSpec

pytestmark = pytest.mark.gpu

GPU_SPECS = [
    ModeSpec(mode="tf32"),
    ModeSpec(mode="amp_bf16"),
    ModeSpec(mode="amp_fp16"),
    ModeSpec(mode="bf16_kahan"),
    ModeSpec(mode="amp_bf16", optimizer_bits=8),
    ModeSpec(mode="fp8_torchao", fp8_recipe="torchao_tensorwise"),
    ModeSpec(mode="fp8_torchao", fp8_recipe="torchao_rowwise"),
    ModeSpec(mode="fp8_te", fp8_recipe="te_delayed_hybrid"),
    ModeSpec(mode="fp8_te", fp8_recipe="te_current"),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    )


@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda spec: spec.label)
# no scheduler to rebind: a mode that rebuilds the optimizer says so (seen failing the first GPU
# run, where pytest turns warnings into errors)
@pytest.mark.filterwarnings("ignore::autoprec.errors.OptimizerRebuiltWarning")
def test_mode_trains_on_gpu(spec: ModeSpec) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (found: CPU only)")
    model = _model().cuda()
    reasons = mode_for(spec).requirements(situation_for_model(model))
    if reasons:
        pytest.skip("; ".join(reasons))
    plan = autoprec.prepare(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = torch.randn(512, 256, device="cuda")
    target = torch.sin(data)
    losses = []
    for _ in range(60):
        with plan.autocast():
            loss = (plan.model(data).float() - target).pow(2).mean()
        plan.step(loss)
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses[::10]
