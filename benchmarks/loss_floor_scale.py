"""The loss checks' floor in loss units, against one that scales: do the gate's verdicts move?

The gate judges a loss gap against a noise floor of at least 1% of the loss, and the forward
pass's cost against 1% of it; below both sat a floor of 1e-4 in loss units until 2026-11-29.
A mean-reduced loss that trains below 1e-2 was judged by that 1e-4 alone: an exact linear
regression passed amp_bf16 while its summed twin (the same model, the loss times the number of
outputs) was rejected. The floor is now ``loss_floor_start`` (a share of the reference's first
training loss: scale-free), and ``loss_floor_absolute`` is off by default.

This runs the gate once per task (``screen_setup``/``screen_trials``, ``check()``'s own trials)
and judges every trial twice, under the old floor (``OLD``) and today's defaults; printed per
pair: both verdicts, the reference's held-out loss and both floors in loss units, a verdict
that moves marked. No long run is needed: where no verdict moves, the ground truth's confusion
matrices cannot move. Then the twins (``--no-twins`` skips them): an exact linear regression
with its MSE mean-reduced and summed, judged the same way, and trained ``--steps`` steps
(``--seeds`` each, fp32 and amp_bf16, through ``apply()`` as the ground truth trains) to show
what the long runs say.

    python -m benchmarks.loss_floor_scale [--tasks cosine_regression,...] [--trial-steps 200]
    python -m benchmarks.loss_floor_scale --quick     # digits_mlp and the twins, short: CI

Measured on 2026-11-29 (14 tasks, one thread, about 25 minutes a run): 0 of 172 verdicts moved,
with the share at 1e-9 and again at today's 2^-48; the
smallest reference held-out loss after a trial is the fine-tune's 0.061, whose 1% is 6x the old
floor. The twins: amp_bf16 safe -> unsafe as a mean (held-out loss 5.4e-8 after the trial,
forward cost +322%), unsafe under both as a sum; 2000-step runs end amp_bf16 5570x and 5620x
worse than fp32 (test loss 1.46e-5 against 2.63e-9 as a mean).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from autoprec.drift import loss_floor_units
from autoprec.drift_thresholds import DriftThresholds
from autoprec.recipe import TrainingRecipe
from autoprec.screening import screen_setup, screen_trials
from autoprec.specs import ModeSpec
from benchmarks import objects_frozen
from benchmarks.ground_truth import ALL_TASKS, chosen_tasks, long_run, task_parser
from benchmarks.ground_truth_heldout import HELDOUT_TASKS
from benchmarks.ground_truth_tasks import TASKS, GroundTask

OLD = DriftThresholds(loss_floor_start=0.0, loss_floor_absolute=1e-4)
"""The floors until 2026-11-29: 1e-4 in loss units, none scaling with where the loss started."""

QUICK_MODES = ("amp_bf16", "bf16_pure")


@dataclass(frozen=True)
class Judged:
    task: str
    label: str
    old: bool | None
    """Accepted under ``OLD``; None when the trial failed (not judged)."""
    new: bool | None
    heldout_loss: float
    """The reference's mean held-out loss (its late training losses without held-out batches)."""
    old_floor: float
    new_floor: float
    forward_cost: float | None
    """The mode's forward pass alone, a share of the held-out loss (``DriftMetrics``)."""

    @property
    def moved(self) -> bool:
        return self.old != self.new


def _verdict(accepted: bool | None) -> str:
    return "failed" if accepted is None else "safe" if accepted else "unsafe"


def judged_twice(
    task: GroundTask, trial_steps: int, modes: tuple[str, ...] | None = None
) -> list[Judged]:
    """Every mode's trial on ``task`` judged under ``OLD`` and under today's defaults."""
    setup = screen_setup(task.model, task.batches, task.recipe, eval_fn=task.eval_fn, modes=modes)
    run = screen_trials(setup, trial_steps)
    reference = run.references.reference.record
    losses = reference.heldout_losses or reference.losses
    rows = []
    for trial, verdict in zip(run.trials, run.verdicts, strict=True):
        failed = verdict.status == "failed"
        old = None if failed else run.references.judge(trial, OLD).accepted
        judged = None if failed else run.references.judge(trial, DriftThresholds())
        new = None if judged is None else judged.accepted
        if new is not None and new != (verdict.status == "safe"):
            raise AssertionError(f"{task.name}:{verdict.label} re-judged otherwise than checked")
        rows.append(
            Judged(
                task.name,
                verdict.label,
                old,
                new,
                statistics.fmean(losses),
                loss_floor_units(reference, OLD),
                loss_floor_units(reference, DriftThresholds()),
                None if judged is None else judged.metrics.forward_cost,
            )
        )
    return rows


def print_rows(rows: list[Judged]) -> None:
    for row in rows:
        mark = "MOVED" if row.moved else "     "
        cost = "" if row.forward_cost is None else f", forward cost {row.forward_cost:+.1%}"
        print(
            f"{mark} {row.task:24} {row.label:44} {_verdict(row.old):6} -> {_verdict(row.new):6}"
            f"  held-out loss {row.heldout_loss:.3g}, floor in loss units "
            f"{row.old_floor:.3g} -> {row.new_floor:.3g}{cost}",
            flush=True,
        )


def exact_regression(reduction: str, total_steps: int) -> GroundTask:
    """A two-Linear model fitting y = x W exactly, AdamW 3e-3, its MSE ``reduction``
    ("mean" or "sum": the summed loss is 512x the mean over a batch of 64 x 8 outputs)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 8, generator=generator) / 32**0.5
    x = torch.randn(48 * 64, 32, generator=generator)
    batches = [(x[i : i + 64], x[i : i + 64] @ weight) for i in range(0, len(x), 64)]

    def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output.float(), target, reduction=reduction)

    return GroundTask(
        f"exact_regression_{reduction}",
        "exact linear regression",
        nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)),
        batches[:40],
        batches[40:],
        TrainingRecipe(
            total_steps=total_steps,
            optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
            loss_fn=mse,
        ),
    )


def long_runs(task: GroundTask, mode: str, seeds: int, steps: int) -> list[float]:
    """The test metric of ``seeds`` runs of ``mode``, ``steps`` steps each."""
    return [long_run(task, ModeSpec(mode=mode), seed, steps).metric for seed in range(seeds)]


def twins(
    trial_steps: int, steps: int, seeds: int, modes: tuple[str, ...]
) -> dict[str, tuple[list[Judged], list[float], list[float]]]:
    """Per reduction: the judged trials, fp32's and amp_bf16's long-run test losses."""
    results = {}
    for reduction in ("mean", "sum"):
        task = exact_regression(reduction, steps)
        rows = judged_twice(task, trial_steps, modes)
        print_rows(rows)
        fp32, bf16 = (long_runs(task, mode, seeds, steps) for mode in ("fp32", "amp_bf16"))
        ratio = statistics.fmean(bf16) / statistics.fmean(fp32)
        print(
            f"      {task.name}: {steps}-step runs, test loss fp32 {statistics.fmean(fp32):.3g} "
            f"(seeds {min(fp32):.3g}-{max(fp32):.3g}), amp_bf16 {statistics.fmean(bf16):.3g}: "
            f"{ratio:.3g}x fp32's",
            flush=True,
        )
        results[reduction] = (rows, fp32, bf16)
    return results


class Arguments(NamedTuple):
    names: list[str]
    trial_steps: int
    steps: int
    seeds: int
    modes: tuple[str, ...] | None
    twins: bool
    twin_trial_steps: int
    """The twins' trials: at 30 steps their loss is not yet low enough to tell the floors apart."""


def _arguments(argv: list[str] | None) -> Arguments:
    parser = task_parser(
        __doc__, quick="digits_mlp at 30 steps, the twins at 100 and 150-step runs, 2 modes (CI)"
    )
    parser.add_argument("--trial-steps", type=int, default=200, help="the gate's trial length")
    parser.add_argument("--steps", type=int, default=2000, help="the twins' long runs")
    parser.add_argument("--seeds", type=int, default=3, help="the twins' runs per mode")
    parser.add_argument("--no-twins", action="store_true", help="the ground-truth tasks only")
    args = parser.parse_args(argv)
    names = chosen_tasks(
        parser, args, default=(*TASKS, *HELDOUT_TASKS), quick=("digits_mlp",), known=ALL_TASKS
    )
    if args.quick:
        return Arguments(names, 30, 150, 2, QUICK_MODES, not args.no_twins, 100)
    return Arguments(
        names, args.trial_steps, args.steps, args.seeds, None, not args.no_twins, args.trial_steps
    )


@objects_frozen
def main(argv: list[str] | None = None) -> list[Judged]:
    args = _arguments(argv)
    rows = []
    for name in args.names:
        task_rows = judged_twice(ALL_TASKS[name](2000), args.trial_steps, args.modes)
        print_rows(task_rows)
        rows += task_rows
    moved = sum(row.moved for row in rows)
    print(f"\n{moved} of {len(rows)} verdicts moved on {len(args.names)} task(s)\n")
    if args.twins:
        twin_modes = args.modes or QUICK_MODES
        twin_runs = twins(args.twin_trial_steps, args.steps, args.seeds, twin_modes)
        for judged, _, _ in twin_runs.values():
            rows += judged
    return rows


if __name__ == "__main__":
    main()
