"""Running statistics a model updates itself (buffers changed by its forward pass in training
mode): kept in bf16 they stop moving, whatever rounding the optimizer uses.

``examples.running_stats`` standardises its inputs (mean 20, std 3) with a running mean and
variance of momentum 1e-3. The run trains ``--steps`` steps of AdamW (lr 1e-3) over ``--seeds``
seeds, each through ``autoprec.prepare``: fp32; bf16_sr with the standardiser's buffers in bf16
(``keep_fp32=()``, what pure bf16 does to a module it does not know); bf16_sr with the
standardiser kept in fp32 (``keep_fp32=("0",)``, what autoprec's probe now puts there).
Printed: held-out loss (eval mode, 8 batches no step saw) and the running mean's average at the
end (the inputs' mean is 20).

    python -m benchmarks.running_state_rounding [--steps 3000] [--seeds 3]
    python -m benchmarks.running_state_rounding --quick    # 200 steps, 1 seed: the CI variant
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import autoprec
from benchmarks.seeded_runs import prepared_run, run_arguments
from examples import running_stats

VARIANTS: dict[str, autoprec.ModeSpec] = {
    "fp32": autoprec.ModeSpec(mode="fp32"),
    "bf16_sr, statistics in bf16": autoprec.ModeSpec(mode="bf16_sr"),
    "bf16_sr, standardiser kept fp32": autoprec.ModeSpec(mode="bf16_sr", keep_fp32=("0",)),
}


@dataclass(frozen=True)
class Run:
    heldout: float
    running_mean: float


def run(spec: autoprec.ModeSpec, seed: int, steps: int) -> Run:
    model, _ = running_stats.make_model(seed)
    batches = running_stats.make_batches()
    loss, plan = prepared_run(spec, model, batches, running_stats.loss_fn, seed=seed, steps=steps)
    standardiser = plan.model[0]
    assert isinstance(standardiser, running_stats.RunningStandardizer)
    return Run(loss, float(standardiser.mean.float().mean()))


def main(argv: list[str] | None = None) -> dict[str, list[Run]]:
    _, steps, seeds = run_arguments(__doc__, argv, steps=3000, seeds=3, quick=(200, 1))
    runs = {name: [run(spec, s, steps) for s in range(seeds)] for name, spec in VARIANTS.items()}
    print(f"running statistics (momentum 1e-3), {steps} steps, {seeds} seed(s):")
    print(f"  {'':<32} {'held-out loss':>13}  {'running mean':>12}  (each seed)")
    for name, each in runs.items():
        losses = [one.heldout for one in each]
        means = [one.running_mean for one in each]
        seeds_text = ", ".join(f"{loss:.4f}" for loss in losses)
        print(
            f"  {name:<32} {statistics.mean(losses):>13.4f}  "
            f"{statistics.mean(means):>12.2f}  ({seeds_text})"
        )
    return runs


if __name__ == "__main__":
    main()
