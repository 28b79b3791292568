"""Would the movement check see more tensor by tensor? Each gate trial's weakest tensor.

The drift gate's movement check pools every sampled weight of an lr class: a small layer that
loses its updates can hide in a large model's figure (the recommender's MLP head, 2.2k of its
22k weights, carries all of pure bf16's harm there: docs/ground-truth.md). This benchmark runs
``autoprec.check()``'s own trials on each task (``screen_setup`` and ``screen_trials``, 200
steps) and reads every trial's movement per tensor: in each lr leg, the trial's projection onto
the fp32 reference's movement over the same projection of the gate's noise run (the nudged run
where the model draws random numbers, else the paired one), tensors the noise run does not
follow (below ``MIN_PAIRED_MOVEMENT``) left out. Printed per pair: the gate's verdict, the
long-run truth (``benchmarks.ground_truth``'s, from its cache: run it first, or this trains what
is missing), the pooled share and the weakest tensor's. Then what a bar on the weakest tensor
would do: the lowest bar that rejects every accepted pair that hurts, and the accepted fine pairs
it would reject too.

    python -m benchmarks.tensor_movement [--tasks a,b] [--steps 2000] [--trial-steps 200]
    python -m benchmarks.tensor_movement --tasks recommender,digits_convnet   # held-out ones too
    python -m benchmarks.tensor_movement --quick     # 2 tasks, short runs: the CI variant
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoprec.drift_movement import MIN_PAIRED_MOVEMENT, _movement
from autoprec.screening import screen_setup, screen_trials
from autoprec.trial_records import TrialResult
from benchmarks import objects_frozen
from benchmarks.ground_truth import (
    ALL_TASKS,
    Scoring,
    fp32_metrics,
    hurts,
    mode_metric,
    scoring_arguments,
)
from benchmarks.ground_truth_tasks import TASKS


@dataclass(frozen=True)
class TensorShare:
    """One pair: the gate's trial read tensor by tensor, beside its truth."""

    task: str
    label: str
    accepted: bool
    truth_hurts: bool
    pooled: float
    """The trial's projection over the noise run's, all tensors pooled (the weakest leg)."""
    weakest: str
    share: float
    """The weakest tensor's projection over the noise run's (its weakest leg)."""


def _leg_share(
    trial: TrialResult, reference: TrialResult, noise: TrialResult, leg: int, names: list[str]
) -> float | None:
    """The trial's projection onto the reference's movement in ``leg`` over ``names``, over the
    noise run's, by the gate's own arithmetic (``drift_movement._movement``); None where the
    reference did not move them or the noise run does not follow (under
    ``MIN_PAIRED_MOVEMENT``, where the gate does not judge movement either)."""
    theirs = (reference.leg_weights[leg + 1], reference.leg_weights[leg])
    ours = _movement(trial.leg_weights[leg + 1], trial.leg_weights[leg], *theirs, names)
    ceiling = _movement(noise.leg_weights[leg + 1], noise.leg_weights[leg], *theirs, names)
    if ours is None or ceiling is None or ceiling[0] < MIN_PAIRED_MOVEMENT:
        return None
    return ours[0] / ceiling[0]


def shares(
    trial: TrialResult, reference: TrialResult, noise: TrialResult
) -> tuple[float, dict[str, float]]:
    """(all tensors pooled, each sampled tensor): the smallest over the lr legs of
    :func:`_leg_share`; nan pooled when no leg was read."""
    pooled = math.inf
    per_tensor: dict[str, float] = {}
    legs = min(len(trial.leg_weights), len(reference.leg_weights), len(noise.leg_weights)) - 1
    for leg in range(legs):
        names = list(reference.leg_weights[leg])
        share = _leg_share(trial, reference, noise, leg, names)
        pooled = pooled if share is None else min(pooled, share)
        for name in names:
            share = _leg_share(trial, reference, noise, leg, [name])
            if share is not None:
                per_tensor[name] = min(per_tensor.get(name, math.inf), share)
    return (math.nan if pooled == math.inf else pooled), per_tensor


def task_shares(name: str, scoring: Scoring) -> list[TensorShare]:
    """The gate's trials on one task, each read per tensor, beside its truth."""
    steps, cache, seeds = scoring.steps, scoring.cache, scoring.seeds
    task = ALL_TASKS[name](steps)
    setup = screen_setup(task.model, task.batches, task.recipe, eval_fn=task.eval_fn)
    run = screen_trials(setup, scoring.trial_steps)
    references = run.references
    noise = references.nudged or references.paired or references.reference
    fp32 = fp32_metrics(cache, task, steps, seeds.fp32)
    found = []
    for verdict, trial in zip(run.verdicts, run.trials, strict=True):
        if verdict.status == "failed" or not trial.leg_weights:
            continue
        pooled, tensors = shares(trial, references.reference, noise)
        weakest = min(tensors, key=tensors.__getitem__) if tensors else "-"
        metric, runs, _ = mode_metric(cache, task, verdict.spec, steps, seeds.mode)
        found.append(
            TensorShare(
                name,
                verdict.label,
                verdict.status == "safe",
                hurts(metric, fp32, runs),
                pooled,
                weakest,
                tensors.get(weakest, float("nan")),
            )
        )
    return found


def bar_report(rows: list[TensorShare]) -> tuple[float | None, list[TensorShare]]:
    """(the lowest bar on the weakest tensor's share that rejects every accepted pair that
    hurts, the accepted fine pairs at or under it); (None, []) with no such pair."""
    missed = [row.share for row in rows if row.accepted and row.truth_hurts]
    if not missed:
        return None, []
    bar = max(missed)
    return bar, [row for row in rows if row.accepted and not row.truth_hurts and row.share <= bar]


@objects_frozen
def main(argv: list[str] | None = None) -> list[TensorShare]:
    scoring = scoring_arguments(__doc__, argv, default=tuple(TASKS), known=ALL_TASKS)
    print("each gate trial's movement over its noise run's: pooled, and its weakest tensor's")
    rows = []
    for name in scoring.names:
        for row in task_shares(name, scoring):
            rows.append(row)
            gate = "accept" if row.accepted else "reject"
            truth = "hurts" if row.truth_hurts else "fine"
            print(
                f"{row.task:18} {row.label:42} {gate:6} {truth:5}  pooled {row.pooled:6.3f}  "
                f"weakest {row.weakest} {row.share:6.3f}",
                flush=True,
            )
    bar, caught = bar_report(rows)
    if bar is None:
        print("\nno accepted pair hurts: no bar to find")
    else:
        print(
            f"\na bar on the weakest tensor that rejects every accepted pair that hurts sits at "
            f"{bar:.3f}; it also rejects {len(caught)} accepted fine pair(s)"
            + "".join(
                f"\n  {row.task}:{row.label} ({row.weakest} {row.share:.3f})" for row in caught
            )
        )
    return rows


if __name__ == "__main__":
    main()
