"""Modes on a real CUDA GPU. Skipped without one, with the mode's own reasons."""

from __future__ import annotations

import pytest
import torch

import autoprec
from autoprec.eligibility import situations_for_model
from autoprec.modes import mode_for
from autoprec.specs import ModeSpec

pytestmark = pytest.mark.gpu

GPU_SPECS = [
    ModeSpec(mode="tf32"),
    ModeSpec(mode="amp_bf16"),
    ModeSpec(mode="amp_fp16"),
    ModeSpec(mode="bf16_kahan"),
    ModeSpec(mode="amp_bf16", optimizer_bits=8),
    ModeSpec(mode="bf16_sr", optimizer_bits=8),
    # torchao with fp8_layers="all": by its size rule ("worthwhile") neither Linear of _model() is
    # converted, and the FP8 specs trained as plain bf16 autocast
    ModeSpec(mode="fp8_torchao", fp8_recipe="torchao_tensorwise", fp8_layers="all"),
    ModeSpec(mode="fp8_torchao", fp8_recipe="torchao_rowwise", fp8_layers="all"),
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
    reasons = mode_for(spec).requirements(situations_for_model(model)[0])
    if reasons:
        pytest.skip("; ".join(reasons))
    plan = autoprec.prepare(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    if spec.mode.startswith("fp8"):
        assert plan.mode.fp8_modules(plan.model), "no Linear ran in FP8"
    _assert_learns(plan)


def _assert_learns(plan: autoprec.PrecisionPlan) -> None:
    """60 steps of a sine regression bring the loss below 70% of its start (AdamW, lr 1e-3)."""
    losses = _sine_losses(plan)
    assert losses[-1] < 0.7 * losses[0], losses[::10]


def _sine_losses(plan: autoprec.PrecisionPlan, keeps_cuda_stream: bool = False) -> list[float]:
    """The losses of 60 steps of a sine regression on seeded data; with ``keeps_cuda_stream``,
    asserts that no optimizer step draws from the global CUDA stream."""
    torch.manual_seed(1)
    data = torch.randn(512, 256, device="cuda")
    target = torch.sin(data)
    losses = []
    for _ in range(60):
        with plan.autocast():
            loss = (plan.model(data).float() - target).pow(2).mean()
        plan.backward(loss)
        before = torch.cuda.get_rng_state()
        plan.step()
        if keeps_cuda_stream:
            assert torch.equal(torch.cuda.get_rng_state(), before)
        losses.append(loss.item())
    return losses


@pytest.mark.filterwarnings("ignore::autoprec.errors.OptimizerRebuiltWarning")
@pytest.mark.parametrize("mode", ["bf16_sr", "bf16_sr_kahan"])
def test_stochastic_rounding_sgd_trains_on_gpu_and_leaves_the_cuda_stream(mode: str) -> None:
    # against fp32 SGD on the same data, not a fixed bar: SGD at lr 0.05 brings fp32 itself
    # only to 78% of its start in 60 steps (the first H200 run failed a 70% bar, fp32 included)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (found: CPU only)")
    reference = _model().cuda()
    fp32 = autoprec.prepare(
        ModeSpec(mode="fp32"),
        reference,
        torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9),
    )
    expected = _sine_losses(fp32)
    model = _model().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plan = autoprec.prepare(ModeSpec(mode=mode), model, optimizer)
    assert type(plan.optimizer).__name__ == "StochasticSGD"
    losses = _sine_losses(plan, keeps_cuda_stream=True)  # the rounding draws its own stream
    assert losses[-1] < 0.85 * losses[0], losses[::10]
    assert losses[-1] < expected[-1] * 1.01, (losses[::10], expected[::10])


def test_8bit_moments_follow_bitsandbytes_on_the_gpu() -> None:
    """bf16_sr+8bit-optim's moments against AdamW8bit's fused CUDA kernel, on fp32 weights (no
    rounding): bit for bit on the CPU (tests/test_stochastic_optim.py); on a GPU the fused
    kernel may order its float operations otherwise, so within 1e-5 after 50 steps. Not yet
    run on a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (found: CPU only)")
    bnb = pytest.importorskip("bitsandbytes")
    from autoprec.stochastic_optim import StochasticAdamW

    options = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
    start = torch.randn(128, 64, generator=torch.Generator().manual_seed(0)).cuda()
    ours, theirs = (torch.nn.Parameter(start.clone()) for _ in range(2))
    optimizers = (
        StochasticAdamW([ours], state_bits=8, **options),
        bnb.optim.AdamW8bit([theirs], **options),
    )
    for step in range(50):
        grad = torch.randn(128, 64, generator=torch.Generator().manual_seed(step)).cuda()
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    assert (ours.detach() - theirs.detach()).abs().max().item() < 1e-5
    assert optimizers[0].state[ours]["exp_avg_codes"].device.type == "cuda"


def test_mapping_batches_that_are_not_dicts_move_to_the_gpu() -> None:
    # a Hugging Face collator's BatchEncoding is a mapping torch's pytree does not open
    from collections import UserDict

    from autoprec.batching import to_device

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (found: CPU only)")
    moved = to_device(UserDict({"ids": torch.ones(2, 3, dtype=torch.long)}), "cuda")
    assert type(moved) is UserDict and moved["ids"].is_cuda
