"""Does pure bf16's lost weight decay explain its harm? A task trained again without decay.

Pure bf16 applies AdamW's decoupled decay as ``param.mul_(1 - lr * wd)`` on bf16 weights rounded
to nearest: with ``lr * wd`` below half a bf16 ulp (2**-9 of any weight) every weight comes back
unchanged, and the decay never applies (the verdict notes it: ``drift_movement.decay_note``).
This benchmark trains a ground-truth task (default: the conv net, where pure bf16 hurts and only
the optimizer-state rule rejected it; AdamW lr 1e-3, decay 0.01: 1e-5 a step) again with decay
0, in fp32 (8 seeds) and pure bf16 (seeds 0-2), beside its ground-truth runs
with the decay, from the same cache:

- pure bf16 with and without decay: identical when the decay rounds away entirely;
- fp32 with and without decay: how much the decay pure bf16 loses was worth to this task.

    python -m benchmarks.decay_rounding [--tasks a,b] [--threads 1]
    python -m benchmarks.decay_rounding --quick    # 100-step runs, 2 fp32 seeds, 1 bf16: CI
"""

from __future__ import annotations

import statistics

from autoprec.specs import ModeSpec
from benchmarks.ground_truth import FP32_SEEDS, cached_long_run, fp32_metrics, scoring_arguments
from benchmarks.ground_truth_tasks import TASKS, GroundTask, with_optimizer_groups


def without_decay(task: GroundTask) -> GroundTask:
    """``task`` with its optimizer's weight decay set to 0 (its long runs cached apart)."""
    return with_optimizer_groups(task, "no-decay", lambda group: group.update(weight_decay=0.0))


QUICK_STEPS = 100
"""``--quick``'s run length (at the ground truth's quick 300 steps its test took 44 s of the test
suite on our 2-core CPU, most of it pure bf16's conv runs)."""


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[float]]]:
    names, steps, _, cache, _, quick = scoring_arguments(
        __doc__, argv, default=("digits_convnet",), quick=("digits_convnet",)
    )
    fp32_seeds, pure_seeds = (2, 1) if quick else (FP32_SEEDS, 3)
    if quick:  # it checks that the decay rounds away, which shows from the first steps
        steps = QUICK_STEPS
    pure = ModeSpec(mode="bf16_pure")
    results = {}
    for name in names:
        task = TASKS[name](steps)
        runs = {}
        for label, variant in (("decay", task), ("no decay", without_decay(task))):
            runs[f"fp32, {label}"] = fp32_metrics(cache, variant, steps, fp32_seeds)
            runs[f"bf16_pure, {label}"] = [
                cached_long_run(cache, variant, pure, seed, steps).metric
                for seed in range(pure_seeds)
            ]
        results[name] = runs
        print(f"{name} ({steps} steps), test metric by seed:")
        for label, metrics in runs.items():
            seeds = " ".join(f"{m:.5g}" for m in metrics)
            print(f"  {label:20} mean {statistics.fmean(metrics):.5g}  ({seeds})")
        same = runs["bf16_pure, decay"] == runs["bf16_pure, no decay"]
        print(f"  bf16_pure with and without decay identical: {same}", flush=True)
    return results


if __name__ == "__main__":
    main()
