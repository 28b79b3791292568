"""Which learning rates must a short trial train at to judge a decaying schedule? Measured.

A small regression MLP, AdamW with a schedule over a long run (default 3000 steps). The truth:
each mode trains the whole run (the real schedule, stepped every step, through ``apply()``) and
its final held-out loss is compared with fp32's over three batch orders: a mode **hurts** when
it ends worse than fp32's mean by more than 3 seed standard deviations and 2%.

Then each trial design judges every mode with the drift gate, 150-step trials as ``tune()``
runs them on a CPU:

- ``peak``: constant at the schedule's peak lr (what autoprec did before the recipe issue);
- ``legs`` (the default): a leg at the peak, then one at the floor (``FLOOR_QUANTILE``);
- ``replay``: a compressed replay, four legs at the lrs of the four quarters of the schedule.

These three are judged without the optimizer-state rule (``LR_ONLY``), so the columns compare
what each set of learning rates lets the trial see. ``gate`` is the whole default gate on the
``legs`` trials, the state rule included. A design is right when it rejects exactly the modes
that hurt.

Its table (docs/ground-truth.md, "Judging a schedule") was measured while bf16_kahan kept
torch-optimi's bf16 second moment (its +33% and +41% are that moment's); since 2026-11-26 the moment
is fp32 and its row measures the mode as it is.

    python -m benchmarks.lr_schedule_gate [--steps 3000] [--trial-steps 150] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from autoprec.drift import judge
from autoprec.drift_thresholds import DriftThresholds
from autoprec.plan import prepare
from autoprec.recipe import LrPoint, TrainingRecipe
from autoprec.specs import ModeSpec
from autoprec.trial import run_trial
from benchmarks import objects_frozen
from benchmarks.ground_truth_tasks import cosine_to, warmup_linear
from examples import tasks

MODES = ("amp_bf16", "bf16_pure", "bf16_sr", "bf16_kahan", "bf16_sr_kahan")
HURT_UNITS, HURT_FLOOR = 3.0, 0.02


SCHEDULES: dict[str, tuple[float, Callable[..., Any]]] = {
    "cosine 1e-3 -> 1e-5": (1e-3, cosine_to(1e-5)),
    "warm-up + linear decay to 0, peak 1e-3": (1e-3, warmup_linear),
}


def _long_run(
    spec: ModeSpec, task: tasks.Task, recipe: TrainingRecipe, steps: int, order_seed: int
) -> float:
    """Train the whole run in ``spec`` as a user would; the final held-out loss."""
    torch.manual_seed(0)
    model = copy.deepcopy(task.model)
    optimizer = recipe.make_optimizer(task.model, model)
    scheduler = recipe.make_scheduler(optimizer)
    plan = prepare(spec, model, optimizer, scheduler)
    order = torch.randperm(
        len(task.batches), generator=torch.Generator().manual_seed(order_seed)
    ).tolist()
    for step in range(steps):
        x, y = task.batches[order[step % len(order)]]
        with plan.autocast():
            loss = task.mse(plan.model(x), y)
        plan.step(loss)
        scheduler.step()
    plan.model.eval()
    with torch.no_grad(), plan.autocast():
        losses = [float(task.mse(plan.model(x), y)) for x, y in task.heldout]
    return statistics.fmean(losses)


def _replay_points(recipe: TrainingRecipe, task: tasks.Task, legs: int) -> tuple[LrPoint, ...]:
    schedule = recipe.schedule(task.model)
    total = len(schedule)
    return tuple(
        LrPoint(
            role="replay",
            lrs=schedule[(2 * leg + 1) * total // (2 * legs)],
            schedule_step=(2 * leg + 1) * total // (2 * legs),
            total_steps=total,
        )
        for leg in range(legs)
    )


def _designs(recipe: TrainingRecipe, task: tasks.Task) -> dict[str, tuple[LrPoint, ...]]:
    legs = recipe.lr_points(task.model)
    return {
        "peak": (LrPoint(role="constant", lrs=legs[0].lrs),),
        "legs": legs,
        "replay": _replay_points(recipe, task, 4),
    }


LR_ONLY = DriftThresholds(max_rounded_beta2=0.99999)
"""The gate without its optimizer-state rule: which learning rates a trial trains at is judged
by what the trial measures (movement, losses, outputs), not by a rule about states."""


def _verdicts(
    task: tasks.Task,
    recipe: TrainingRecipe,
    points: tuple[LrPoint, ...],
    steps: int,
    thresholds: DriftThresholds,
) -> dict[str, tuple[bool, str, float | None]]:
    """Per mode: (accepted, reasons, update fraction in the weakest leg)."""
    common = {"recipe": recipe, "steps": steps, "heldout": task.heldout, "lr_points": points}
    reference = run_trial(ModeSpec(mode="fp32"), task.model, task.batches, **common)
    noise = run_trial(
        ModeSpec(mode="fp32"), task.model, task.batches, seed=1, shuffle_seed=1, **common
    )
    found = {}
    for mode in MODES:
        result = run_trial(ModeSpec(mode=mode), task.model, task.batches, **common)
        verdict = judge(result, reference, noise, thresholds)
        fraction = verdict.metrics.update_fraction
        found[mode] = (verdict.accepted, "; ".join(verdict.reasons)[:70], fraction)
    return found


QUANTILES = (0.05, 0.1, 0.25, 0.5)


def _quantile_sweep(task: tasks.Task, recipe: TrainingRecipe, steps: int) -> None:
    """How the floor's quantile moves the verdict on bf16_pure (which hurts in both runs)."""
    cells = []
    for quantile in QUANTILES:
        points = recipe.lr_points(task.model, floor_quantile=quantile)
        common = {"recipe": recipe, "steps": steps, "heldout": task.heldout, "lr_points": points}
        reference = run_trial(ModeSpec(mode="fp32"), task.model, task.batches, **common)
        noise = run_trial(
            ModeSpec(mode="fp32"), task.model, task.batches, seed=1, shuffle_seed=1, **common
        )
        trial = run_trial(ModeSpec(mode="bf16_pure"), task.model, task.batches, **common)
        verdict = judge(trial, reference, noise, LR_ONLY)
        floor = points[-1]
        cells.append(
            f"q={quantile:g}: floor lr {floor.lr:.2g} (step {floor.schedule_step}) "
            f"{'pass' if verdict.accepted else 'reject'} {verdict.metrics.update_fraction:.2f}"
        )
    print("   floor quantile vs bf16_pure (verdict, movement): " + "; ".join(cells))


@objects_frozen
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps of a long run")
    parser.add_argument("--trial-steps", type=int, default=150)
    parser.add_argument(
        "--quick", action="store_true", help="one schedule, 200-step runs, 30-step trials"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    steps, trial_steps = (200, 30) if args.quick else (args.steps, args.trial_steps)
    schedules = dict(list(SCHEDULES.items())[:1]) if args.quick else SCHEDULES
    scores = {"peak": 0, "legs": 0, "replay": 0, "gate": 0}
    cases = 0
    for title, (peak, schedule) in schedules.items():
        task = tasks.regression(lr=peak)
        recipe = TrainingRecipe(
            optimizer=task.optimizer, loss_fn=task.mse, scheduler=schedule, total_steps=steps
        )
        started = time.monotonic()
        fp32 = [_long_run(ModeSpec(mode="fp32"), task, recipe, steps, seed) for seed in range(3)]
        mean, spread = statistics.fmean(fp32), statistics.stdev(fp32)
        limit = mean + max(HURT_UNITS * spread, HURT_FLOOR * mean)
        final = {mode: _long_run(ModeSpec(mode=mode), task, recipe, steps, 0) for mode in MODES}
        designs = _designs(recipe, task)
        verdicts = {
            name: _verdicts(task, recipe, points, trial_steps, LR_ONLY)
            for name, points in designs.items()
        }
        verdicts["gate"] = _verdicts(task, recipe, designs["legs"], trial_steps, DriftThresholds())
        designs["gate"] = designs["legs"]
        print(
            f"\n== {title}, {steps} steps: fp32 final held-out loss {mean:.5f} "
            f"(3 batch orders, sd {spread:.2g}); hurts above {limit:.5f} "
            f"({time.monotonic() - started:.0f} s)"
        )
        for name, points in designs.items():
            lrs = ", ".join(f"{p.lr:.2g}" for p in points)
            print(f"   {name:7} trains at lr {lrs}")
        header = "".join(f"{d:>14}" for d in designs)
        print(f"   {'mode':14} {'final loss':>10} {'truth':>6} {header}   (verdict, movement)")
        for mode in MODES:
            hurts = final[mode] > limit
            cases += 1
            cells = []
            for name in designs:
                accepted, _, fraction = verdicts[name][mode]
                right = accepted != hurts
                scores[name] += right
                moved = "  -  " if fraction is None else f"{fraction:5.2f}"
                mark = " " if right else "!"
                cells.append(f"{'pass' if accepted else 'reject':>7}{mark} {moved}")
            truth = "hurts" if hurts else "ok"
            print(f"   {mode:14} {final[mode]:10.5f} {truth:>6} " + "".join(cells))
        for name in designs:
            wrong = [
                f"{mode} ({reason or 'accepted'})"
                for mode in MODES
                if verdicts[name][mode][0] == (final[mode] > limit)
                for reason in [verdicts[name][mode][1]]
            ]
            if wrong:
                print(f"   {name} wrong on: " + "; ".join(wrong))
        _quantile_sweep(task, recipe, trial_steps)
    print(
        "\nverdicts matching the long runs: "
        + ", ".join(f"{name} {right}/{cases}" for name, right in scores.items())
        + "   (! marks a wrong verdict)"
    )


if __name__ == "__main__":
    main()
