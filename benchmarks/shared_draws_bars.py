"""Which verdicts the nudged run moves: every ground-truth task whose training draws random
numbers, judged with and without it.

A model with random draws (dropout, noise in a diffusion loss) gets, beside the paired fp32 run
(other draws), a nudged one: the reference's draws from weights nudged by 2^-12. A trial
that drew the reference's draws is judged against the nudged run; before it existed, against
the movement and output floors alone. This benchmark trains ``autoprec.check()``'s own trials
(``screen_setup``, ``screen_trials``; ``--trial-steps``, default 200) on each task of
``benchmarks.ground_truth`` and ``benchmarks.ground_truth_heldout`` whose calibration draws
random numbers (the others are skipped, with a line saying so) and judges every mode both ways,
from the same runs. Printed: each pair's verdict with the nudged run and without it, and
every pair whose verdict differs (the ground truth's matrix can move only there). No long run
is needed: the truth does not change with the gate.

    python -m benchmarks.shared_draws_bars [--tasks a,b] [--trial-steps 200]
    python -m benchmarks.shared_draws_bars --quick    # the dropout regression, 20 steps: CI
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from autoprec.drift import judge
from autoprec.run_setup import calibration_run
from autoprec.screening import screen_setup, screen_trials
from benchmarks import objects_frozen
from benchmarks.ground_truth import ALL_TASKS
from benchmarks.ground_truth_tasks import GroundTask
from examples import tasks


@dataclass(frozen=True)
class Rejudged:
    task: str
    mode: str
    with_nudged: tuple[str, ...]
    """The reasons with the nudged run (none: accepted)."""
    floors_alone: tuple[str, ...]
    """The reasons without it."""
    shared_draws: bool


def _dropout_regression(_steps: int) -> GroundTask:
    from autoprec.recipe import TrainingRecipe

    task = tasks.regression(lr=1e-3, dropout=0.1)
    recipe = TrainingRecipe(optimizer=task.optimizer, loss_fn=task.mse)
    return GroundTask(
        "dropout_regression", "regression with dropout", task.model, task.batches,
        task.heldout, recipe,
    )  # fmt: skip


def rejudge(task: GroundTask, trial_steps: int) -> list[Rejudged] | None:
    """Every mode's verdict with and without the nudged run (None: the task draws nothing)."""
    setup = screen_setup(task.model, task.batches, task.recipe, eval_fn=task.eval_fn)
    if not calibration_run(setup)[2]:  # its few fp32 steps tell whether training draws
        return None
    run = screen_trials(setup, trial_steps)
    refs = run.references
    rows = []
    for trial in run.trials:
        with_nudged = refs.judge(trial, setup.thresholds)
        alone = judge(trial, refs.reference, refs.noise, setup.thresholds, paired=refs.paired)
        rows.append(
            Rejudged(
                task=task.name,
                mode=trial.record.spec.label,
                with_nudged=with_nudged.reasons,
                floors_alone=alone.reasons,
                shared_draws=any("drew the reference's" in n for n in with_nudged.notes),
            )
        )
    return rows


def _verdict(reasons: tuple[str, ...]) -> str:
    return "accept" if not reasons else f"reject ({reasons[0][:60]})"


@objects_frozen
def main(argv: list[str] | None = None) -> list[Rejudged]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", help="comma-separated (default: every ground-truth task)")
    parser.add_argument("--trial-steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="the dropout regression, 20 steps")
    args = parser.parse_args(argv)
    every = list(ALL_TASKS)
    builders = (
        {"dropout_regression": _dropout_regression}
        if args.quick
        else {name: ALL_TASKS[name] for name in (args.tasks.split(",") if args.tasks else every)}
    )
    steps = 20 if args.quick else args.trial_steps
    rows: list[Rejudged] = []
    for name, build in builders.items():
        judged = rejudge(build(2000), steps)
        if judged is None:
            print(f"{name}: draws no random numbers (no nudged run beside the paired one)")
            continue
        for row in judged:
            moved = " MOVED" if bool(row.with_nudged) != bool(row.floors_alone) else ""
            shared = "shares the draws" if row.shared_draws else "draws otherwise"
            print(
                f"{name:18} {row.mode:34} {shared:17} with the nudged run: "
                f"{_verdict(row.with_nudged)}; floors alone: {_verdict(row.floors_alone)}{moved}",
                flush=True,
            )
        rows += judged
    moved_rows = [r for r in rows if bool(r.with_nudged) != bool(r.floors_alone)]
    print(f"{len(rows)} pairs judged both ways; verdicts moved: {len(moved_rows)}")
    for row in moved_rows:
        before, after = _verdict(row.floors_alone), _verdict(row.with_nudged)
        print(f"  {row.task} {row.mode}: {before} -> {after}")
    return rows


if __name__ == "__main__":
    main()
