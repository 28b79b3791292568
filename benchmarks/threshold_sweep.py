"""Each drift-gate threshold against the ground truth: what other values would have decided.

The gate's trials run once per task (``autoprec.check()``'s own trials: ``screen_setup`` and
``screen_trials``, 200 steps); the fp32 reference, noise and paired runs they are judged against
are the same. Then every trial is judged again with one threshold of ``DriftThresholds`` moved
to each value of its grid, the others at their defaults, and scored against the long runs of
``benchmarks.ground_truth`` (its truth, its cache: run it first, or this trains what is
missing). Printed per threshold and value: false accepts and false rejects over all pairs, and
which pairs change verdict against the defaults; then the same with the optimizer-state rule
off, which otherwise rejects every pure-bf16 mode first and hides what the other checks do. A
check first re-judges at the defaults and must reproduce every recorded verdict.

This is a sensitivity measurement, not a fit: the defaults were set before it ran (README, "Trials
and the drift gate"; docs/ground-truth.md), and a value that scores better on these 114 pairs would
be chosen on the same pairs it is scored on.

    python -m benchmarks.threshold_sweep [--tasks a,b] [--steps 2000] [--trial-steps 200]
    python -m benchmarks.threshold_sweep --quick     # 2 tasks, short runs: the CI variant
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from autoprec.drift_thresholds import DriftThresholds
from autoprec.screening import ScreenRun, screen_setup, screen_trials
from benchmarks import objects_frozen
from benchmarks.ground_truth import (
    Scoring,
    fp32_metrics,
    hurts,
    mode_metric,
    scoring_arguments,
)
from benchmarks.ground_truth_tasks import TASKS

OFF = 1e6
"""A bar no trial reaches: the check it belongs to is off."""

GRID: dict[str, tuple[float, ...]] = {
    "max_loss_gap_units": (1.5, 2.0, 3.0, 4.0, 6.0, OFF),
    "loss_floor_relative": (0.0, 0.005, 0.01, 0.02, 0.05),
    "loss_floor_start": (0.0, 2**-48, 1e-9, 1e-6, 1e-4),
    "loss_floor_absolute": (0.0, 1e-5, 1e-4, 1e-3),
    "late_fraction": (0.1, 0.25, 0.5, 1.0),
    "min_update_fraction": (0.0, 0.5, 0.7, 0.8, 0.9, 0.95),
    "max_output_error_units": (2.0, 3.0, 5.0, 10.0),
    "output_error_floor": (0.05, 0.1, 0.2, 0.3, OFF),
    "max_rounded_beta2": (1 - 2**-8, 0.9995),
    "fp16_headroom": (1 / 32, 1 / 16, 0.25, 1.0),
    "max_skipped_step_rate": (0.02, 0.1, 0.3),
    "max_eval_gap_units": (2.0, 3.0, 5.0),
    "eval_floor_relative": (0.01, 0.02, 0.05, OFF),
    "max_forward_cost": (0.005, 0.01, 0.02, OFF),
}
"""Values tried per threshold; each grid holds the default. Some values turn a check off, to
show what it alone catches: ``OFF`` for the loss, output, eval_fn and forward-cost bars, a
``min_update_fraction`` of 0 (the movement check), a ``max_rounded_beta2`` of 0.9995 (lets
beta2 = 0.999 through: the optimizer-state rule)."""


@dataclass(frozen=True)
class JudgedPair:
    task: str
    label: str
    truth_hurts: bool
    run: ScreenRun
    index: int
    """The pair's position in ``run.trials`` / ``run.verdicts``."""
    judged: dict[DriftThresholds, bool] = dataclasses.field(default_factory=dict, compare=False)
    """Verdicts by thresholds: each grid repeats its base, and judging compares ~1M sampled
    weights per leg."""

    def accepted(self, thresholds: DriftThresholds) -> bool | None:
        """The gate's verdict under ``thresholds``; None when the trial crashed (not judged)."""
        if self.run.verdicts[self.index].status == "failed":
            return None
        if thresholds not in self.judged:
            trial = self.run.trials[self.index]
            self.judged[thresholds] = self.run.references.judge(trial, thresholds).accepted
        return self.judged[thresholds]


def task_pairs(name: str, scoring: Scoring) -> list[JudgedPair]:
    """The gate's trials on one task, each beside its truth."""
    steps, cache, seeds = scoring.steps, scoring.cache, scoring.seeds
    task = TASKS[name](steps)
    setup = screen_setup(task.model, task.batches, task.recipe, eval_fn=task.eval_fn)
    run = screen_trials(setup, scoring.trial_steps)
    fp32 = fp32_metrics(cache, task, steps, seeds.fp32)
    pairs = []
    for index, verdict in enumerate(run.verdicts):
        metric, runs, _ = mode_metric(cache, task, verdict.spec, steps, seeds.mode)
        pairs.append(JudgedPair(name, verdict.label, hurts(metric, fp32, runs), run, index))
    print(f"{name}: {len(pairs)} pairs, fp32 {statistics.fmean(fp32):.5g}", flush=True)
    return pairs


def errors(pairs: list[JudgedPair], thresholds: DriftThresholds) -> tuple[set[str], set[str]]:
    """(false accepts, false rejects) as ``task:label`` names."""
    false_accepts, false_rejects = set(), set()
    for pair in pairs:
        accepted = pair.accepted(thresholds)
        if accepted is None:
            continue
        name = f"{pair.task}:{pair.label}"
        if accepted and pair.truth_hurts:
            false_accepts.add(name)
        elif not accepted and not pair.truth_hurts:
            false_rejects.add(name)
    return false_accepts, false_rejects


def check_defaults(pairs: list[JudgedPair]) -> None:
    """Judged again at the defaults, every pair must get its recorded verdict."""
    for pair in pairs:
        recorded = pair.run.verdicts[pair.index].status
        accepted = pair.accepted(DriftThresholds())
        if accepted is not None and accepted != (recorded == "safe"):
            raise AssertionError(f"{pair.task}:{pair.label} re-judged differently ({recorded})")


STATE_RULE_OFF = DriftThresholds(max_rounded_beta2=0.9995)
"""Every default but the optimizer-state rule, which rejects every pure-bf16 mode with 32-bit
states and Adam's default beta2 whatever else it does (bf16_kahan too, until its second moment
moved to fp32): the second sweep shows what the other checks catch among those modes."""


def sweep(
    pairs: list[JudgedPair], base: DriftThresholds, title: str
) -> list[tuple[str, float, int, int]]:
    """(threshold, value, false accepts, false rejects) for every grid point, each field moved
    from ``base``; printed with the pairs that change verdict against ``base``."""
    base_accepts, base_rejects = errors(pairs, base)
    print(
        f"\n{title}: {len(base_accepts)} false accepts, {len(base_rejects)} false rejects "
        f"over {len(pairs)} pairs"
    )
    print(f"{'threshold':24} {'value':>8} {'FA':>3} {'FR':>3}  changes against the base")
    rows = []
    for field, values in GRID.items():
        for value in values:
            accepts, rejects = errors(pairs, base.model_copy(update={field: value}))
            changes = [f"+FA {n}" for n in sorted(accepts - base_accepts)]
            changes += [f"-FA {n}" for n in sorted(base_accepts - accepts)]
            changes += [f"+FR {n}" for n in sorted(rejects - base_rejects)]
            changes += [f"-FR {n}" for n in sorted(base_rejects - rejects)]
            mark = "*" if math.isclose(value, getattr(base, field)) else " "
            shown = "off" if value == OFF else f"{value:.4g}"
            print(
                f"{field:24} {shown:>7}{mark} {len(accepts):>3} {len(rejects):>3}  "
                + ("; ".join(changes) or "-"),
                flush=True,
            )
            rows.append((field, value, len(accepts), len(rejects)))
    return rows


@objects_frozen
def main(argv: list[str] | None = None) -> list[tuple[str, float, int, int]]:
    scoring = scoring_arguments(__doc__, argv)
    pairs = [pair for name in scoring.names for pair in task_pairs(name, scoring)]
    check_defaults(pairs)
    rows = sweep(pairs, DriftThresholds(), "The defaults")
    sweep(pairs, STATE_RULE_OFF, "The optimizer-state rule off, every other default")
    return rows


if __name__ == "__main__":
    main()
