"""How far do activations and gradients grow after the gate's trial? The fp16 headroom measured.

The gate flags amp_fp16 when the trial's held-out activations or its gradients reach
``DriftThresholds.fp16_headroom`` (1/16; a quarter before this benchmark) of fp16's largest
value, 65504: the forward pass overflows whatever the loss scaler does, and a trial sees only the
start of a run. 1/16 leaves room for 16x growth after the trial. This benchmark measures the
growth on each ground-truth task: it trains the task in fp32 (``ground_truth.long_run``: its
recipe and lr schedule, seed 0) and reads the range as the trial reads it:

- **activations**: the largest |output| of any leaf module on the 4 batches ``check()`` holds out
  (``trial_loop.heldout_pass``, eval mode), after the trial's 200 steps and at each later
  checkpoint;
- **gradients**: the largest |gradient| element over the steps since the previous checkpoint
  (``trial_measures.max_abs_gradient``), the first window being the trial's 200 steps.

Printed per task: both ranges at step 200 and as multiples of it at each later checkpoint, and
the largest multiple over the tasks, against the 4x the default leaves.

    python -m benchmarks.fp16_headroom [--steps 2000] [--tasks a,b] [--threads 1]
    python -m benchmarks.fp16_headroom --quick    # 1 task, 500 steps: the CI variant
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autoprec.drift_fp16 import FP16_MAX
from autoprec.drift_thresholds import DriftThresholds
from autoprec.plan import PrecisionPlan
from autoprec.run_inputs import collect_batches, preserved_rng
from autoprec.run_setup import HELDOUT_BATCHES
from autoprec.specs import ModeSpec
from autoprec.trial_loop import heldout_pass
from autoprec.trial_measures import max_abs_gradient
from benchmarks.ground_truth import long_run, run_arguments
from benchmarks.ground_truth_tasks import TASKS, GroundTask

TRIAL_STEPS = 200
"""The gate's default trial: the ranges it sees are the base of every growth figure."""
CHECKPOINTS = (TRIAL_STEPS, 500, 1000, 2000, 5000, 10000)


@dataclass
class RangeLog:
    """The ranges of one run at each checkpoint (optimizer step -> largest |value|)."""

    activations: dict[int, float] = field(default_factory=dict)
    gradients: dict[int, float] = field(default_factory=dict)
    """The largest |gradient| element over the steps since the previous checkpoint."""

    def growth(self, kind: str, step: int) -> float:
        """The range at ``step`` as a multiple of the trial's (step 200)."""
        ranges = self.activations if kind == "activations" else self.gradients
        base = ranges[TRIAL_STEPS]
        return ranges[step] / base if base > 0 else float("inf")


def follow_ranges(plan: PrecisionPlan, task: GroundTask, log: RangeLog) -> None:
    """Hooks ``plan``'s optimizer to fill ``log``: the gradient range before every step, the
    activation range on the held-out batches after each checkpoint's step (the global RNG left
    as it was: a loss that draws noise must not shift the run)."""
    heldout = collect_batches(task.batches)[-HELDOUT_BATCHES:]
    device = next(plan.model.parameters()).device
    window_peak = [0.0]
    steps = [0]

    def before_step(*_: Any) -> None:
        largest = max_abs_gradient(plan)
        if largest is not None:
            window_peak[0] = max(window_peak[0], float(largest))

    def after_step(*_: Any) -> None:
        steps[0] += 1
        if steps[0] not in CHECKPOINTS:
            return
        log.gradients[steps[0]], window_peak[0] = window_peak[0], 0.0
        with preserved_rng():
            _, _, watched = heldout_pass(plan, heldout, device, task.recipe.loss_fn, None)
        log.activations[steps[0]] = watched.largest

    plan.optimizer.register_step_pre_hook(before_step)
    plan.optimizer.register_step_post_hook(after_step)


def measure(name: str, steps: int) -> RangeLog:
    """The task trained ``steps`` fp32 steps (seed 0), its ranges logged."""
    log = RangeLog()
    task = TASKS[name](steps)
    long_run(task, ModeSpec(mode="fp32"), 0, steps, lambda plan: follow_ranges(plan, task, log))
    return log


def _row(name: str, kind: str, log: RangeLog, shown: list[int]) -> str:
    ranges = log.activations if kind == "activations" else log.gradients
    later = "".join(f"{f'{log.growth(kind, step):.2f}x':>9}" for step in shown[1:])
    return f"{name:20}{kind:12}{ranges[TRIAL_STEPS]:>11.3g}{later}"


def main(argv: list[str] | None = None) -> dict[str, RangeLog]:
    names, steps, parser = run_arguments(
        __doc__, argv, default=list(TASKS), quick=["digits_mlp"], quick_steps=500
    )
    if steps < TRIAL_STEPS:
        parser.error(f"--steps must be at least the trial's {TRIAL_STEPS}, got {steps}")
    shown = [c for c in CHECKPOINTS if c <= steps]
    margin = 1 / DriftThresholds().fp16_headroom
    print(
        f"fp32 ranges at the trial's end (step {TRIAL_STEPS}) and as multiples of it later; "
        f"the fp16 check flags 1/{margin:g} of {FP16_MAX:.0f}, leaving {margin:g}x for growth"
    )
    print(f"{'task':20}{'range of':12}{'step 200':>11}" + "".join(f"{c:>9}" for c in shown[1:]))
    logs = {}
    for name in names:
        logs[name] = measure(name, steps)
        for kind in ("activations", "gradients"):
            print(_row(name, kind, logs[name], shown), flush=True)
    for kind in ("activations", "gradients"):
        growth, name, step = max(
            (logs[name].growth(kind, step), name, step) for name in names for step in shown
        )
        peak = max(max(getattr(log, kind).values()) for log in logs.values())
        print(
            f"{kind}: largest growth after the trial {growth:.2f}x ({name}, step {step}); "
            f"largest value {peak:.3g} = {peak / FP16_MAX:.2%} of fp16's range"
        )
    return logs


if __name__ == "__main__":
    main()
