"""Spectral norm's power-iteration vectors in bf16: do they need keeping in fp32?

They are buffers the forward pass changes in training, like running statistics, but not
averages: each forward recomputes them from the weight (``v = normalize(W^T u)``,
``u = normalize(W v)``), so no small increment accumulates to round away. The probe therefore
does not keep their modules in fp32 (with ``nn.utils.spectral_norm``'s hook the module is the
Linear itself, which would then train in fp32 under pure bf16).

An MLP with spectral norm on its three hidden Linears regresses ``sin(x w / 4)`` with noise
(AdamW lr 1e-3, batches of 64, ``--steps`` steps, ``--seeds`` seeds), through
``autoprec.prepare``: fp32; bf16_sr with the spectral-norm modules kept fp32 (what the probe did
before); bf16_sr with their vectors in bf16 (what it does now). Both spectral norms: the hook
(``nn.utils.spectral_norm``) and the parametrization (``nn.utils.parametrizations``). Printed:
held-out loss (eval mode, 8 batches no step saw; the noise alone scores 0.010).

    python -m benchmarks.spectral_norm_rounding [--steps 2000] [--seeds 3]
    python -m benchmarks.spectral_norm_rounding --quick    # 100 steps, 1 seed: the CI variant
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

import autoprec
from benchmarks.seeded_runs import prepared_run, run_arguments

STYLES = ("hook", "parametrization")
HIDDEN = ("0", "2", "4")


def make_model(seed: int, style: str) -> nn.Sequential:
    torch.manual_seed(seed)
    normed = {"hook": nn.utils.spectral_norm}.get(style, nn.utils.parametrizations.spectral_norm)
    return nn.Sequential(
        normed(nn.Linear(16, 128)), nn.GELU(),
        normed(nn.Linear(128, 128)), nn.GELU(),
        normed(nn.Linear(128, 128)), nn.GELU(),
        nn.Linear(128, 1),
    )  # fmt: skip


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 1, generator=generator)
    batches = []
    for _ in range(80):
        x = torch.randn(64, 16, generator=generator)
        noise = 0.1 * torch.randn(64, 1, generator=generator)
        batches.append((x, torch.sin(x @ weight / 4) + noise))
    return batches


def variants(style: str) -> dict[str, autoprec.ModeSpec]:
    kept = HIDDEN if style == "hook" else tuple(f"{i}.parametrizations.weight.0" for i in HIDDEN)
    return {
        "fp32": autoprec.ModeSpec(mode="fp32"),
        "bf16_sr, spectral norm kept fp32": autoprec.ModeSpec(mode="bf16_sr", keep_fp32=kept),
        "bf16_sr, its vectors in bf16": autoprec.ModeSpec(mode="bf16_sr"),
    }


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.float(), target)


def run(spec: autoprec.ModeSpec, style: str, seed: int, steps: int) -> float:
    model = make_model(seed, style)
    return prepared_run(spec, model, make_batches(), _mse, seed=seed, steps=steps)[0]


def main(argv: list[str] | None = None) -> dict[tuple[str, str], list[float]]:
    _, steps, seeds = run_arguments(__doc__, argv, steps=2000, seeds=3, quick=(100, 1))
    print(f"spectral norm's vectors, {steps} steps, {seeds} seed(s): held-out loss (each seed)")
    results: dict[tuple[str, str], list[float]] = {}
    for style in STYLES:
        for name, spec in variants(style).items():
            losses = [run(spec, style, seed, steps) for seed in range(seeds)]
            results[(style, name)] = losses
            each = ", ".join(f"{loss:.5f}" for loss in losses)
            print(f"  {style:15} {name:34} {statistics.mean(losses):.5f}  ({each})", flush=True)
    return results


if __name__ == "__main__":
    main()
