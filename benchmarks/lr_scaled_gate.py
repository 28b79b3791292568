"""Would a trial at a smaller lr see pure bf16's late harm? The gate with the recipe's lr scaled.

Pure bf16 with 8-bit states passes the gate on the AdamW conv net and the recommender and its
long runs hurt (docs/ground-truth.md): late in a run Adam's steps shrink (its update tends to
about sqrt((1 - beta1) / (1 + beta1)) = 0.23 of the lr once the gradient is mostly noise) and
more of them fall under half a bf16 ulp of their weights. A trial from the initial weights at
the full lr does not reach that regime. This benchmark runs ``autoprec.check()``'s trial with
every lr of the task's recipe (its schedule's too) scaled by each of ``--scales``, and prints
each verdict beside the long-run truth at the real lr (``benchmarks.ground_truth``'s, from its
cache: run it first, or this trains what is missing), then false accepts and false rejects per
scale: the question is whether one scale rejects the harmful accepts and keeps the fine ones.

    python -m benchmarks.lr_scaled_gate [--tasks a,b] [--scales 1,0.5,0.35,0.23] [--modes ...]
    python -m benchmarks.lr_scaled_gate --tasks recommender,digits_convnet,encoder_dropout
    python -m benchmarks.lr_scaled_gate --tasks nanogpt_recipe --gate-only  # no long runs
    python -m benchmarks.lr_scaled_gate --quick     # 2 tasks, short runs: the CI variant
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.ground_truth import (
    ALL_TASKS,
    Scoring,
    float_list,
    fp32_metrics,
    gate,
    hurts,
    mode_metric,
    scoring_arguments,
)
from benchmarks.ground_truth_tasks import TASKS, GroundTask, changed_groups

DEFAULT_SCALES = (1.0, 0.5, 0.35, 0.23)
DEFAULT_MODES = ("bf16_pure", "bf16_pure+8bit-optim", "bf16_sr", "bf16_kahan", "bf16_sr_kahan")
"""The modes whose weights round: the ones a smaller step could expose."""


@dataclass(frozen=True)
class ScaledVerdict:
    """One pair's gate verdict with the lr scaled by ``scale``, beside its truth."""

    task: str
    label: str
    scale: float
    accepted: bool
    truth_hurts: bool | None
    """None under ``--gate-only`` (no long run read or trained)."""
    movement: float
    """The trial's ``update_fraction`` (its weights' movement over fp32's); nan where none."""
    reasons: tuple[str, ...]


def scaled_optimizer(factory: Callable[..., Any], scale: float) -> Callable[..., Any]:
    """``factory`` with every group's lr multiplied by ``scale`` (a scheduler built on the
    optimizer afterwards takes the scaled lr as its base)."""

    def scale_lr(group: dict[str, Any]) -> None:
        group["lr"] = group["lr"] * scale

    return changed_groups(factory, scale_lr)


def scaled_schedule(factory: Callable[..., Any], scale: float) -> Callable[..., Any]:
    """``factory`` (on an optimizer whose lrs are scaled already) with the lrs its schedule
    holds in absolute terms scaled too: CosineAnnealingLR's floor, OneCycleLR's lrs (it sets
    every lr itself, from its ``max_lr``). LambdaLR multiplies the scaled lr as it is. Other
    schedulers are refused: an absolute lr left unscaled would judge a schedule no one runs."""

    @functools.wraps(factory)  # keeps its signature: check() reads whether it takes total_steps
    def build(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        schedule = factory(optimizer, *args, **kwargs)
        if isinstance(schedule, torch.optim.lr_scheduler.CosineAnnealingLR):
            schedule.eta_min *= scale
        elif isinstance(schedule, torch.optim.lr_scheduler.OneCycleLR):
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * scale  # its start, from max_lr
                for key in ("initial_lr", "max_lr", "min_lr"):
                    group[key] *= scale
        elif not isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
            raise SystemExit(
                f"lr_scaled_gate cannot scale a {type(schedule).__name__}'s lrs; it scales "
                "LambdaLR, CosineAnnealingLR and OneCycleLR"
            )
        return schedule

    return build


def with_scaled_lr(task: GroundTask, scale: float) -> GroundTask:
    """The task with its recipe's lr scaled (its schedule's too); model, data and everything
    else the same."""
    recipe = task.recipe
    optimizer = scaled_optimizer(recipe.optimizer, scale)
    schedule = None if recipe.scheduler is None else scaled_schedule(recipe.scheduler, scale)
    # a recipe of its own: replace() would share the recipe's cache of the schedule it read
    scaled = dataclasses.replace(recipe, optimizer=optimizer, scheduler=schedule, _cache={})
    return dataclasses.replace(task, recipe=scaled)


def task_verdicts(
    name: str, scoring: Scoring, scales: list[float], modes: list[str], gate_only: bool = False
) -> list[ScaledVerdict]:
    """The gate on one task at each lr scale, each verdict beside its long-run truth (none
    with ``gate_only``: for tasks whose long runs are not cached, without training them)."""
    steps, cache, seeds = scoring.steps, scoring.cache, scoring.seeds
    task = ALL_TASKS[name](steps)  # built once: check() trains copies, never the model
    fp32 = None if gate_only else fp32_metrics(cache, task, steps, seeds.fp32)
    found = []
    for scale in scales:
        report = gate(with_scaled_lr(task, scale), scoring.trial_steps, modes)
        for verdict in report.verdicts:
            if verdict.status == "failed":
                continue
            truth = None
            if fp32 is not None:
                metric, runs, _ = mode_metric(cache, task, verdict.spec, steps, seeds.mode)
                truth = hurts(metric, fp32, runs)
            found.append(
                ScaledVerdict(
                    name,
                    verdict.label,
                    scale,
                    verdict.status == "safe",
                    truth,
                    verdict.drift.get("update_fraction", float("nan")),
                    verdict.reasons,
                )
            )
    return found


def errors_by_scale(rows: list[ScaledVerdict]) -> dict[float, tuple[int, int, int]]:
    """Per scale: (false accepts, false rejects, pairs with a truth)."""
    found: dict[float, tuple[int, int, int]] = {}
    for scale in dict.fromkeys(row.scale for row in rows):
        at = [row for row in rows if row.scale == scale and row.truth_hurts is not None]
        false_accepts = sum(1 for row in at if row.accepted and row.truth_hurts)
        false_rejects = sum(1 for row in at if not row.accepted and row.truth_hurts is False)
        found[scale] = (false_accepts, false_rejects, len(at))
    return found


def scale_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scales",
        default=",".join(f"{s:g}" for s in DEFAULT_SCALES),
        help="lr factors in (0, 1], comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help="modes to check (default: %(default)s)"
    )
    parser.add_argument(
        "--gate-only",
        action="store_true",
        help="the gate's verdicts alone: no long run read or trained (tasks not cached)",
    )


def scales_and_modes(
    argv: list[str] | None,
) -> tuple[list[float], list[str], bool, list[str]]:
    """``--scales``, ``--modes``, ``--gate-only`` and the other arguments."""
    pre = argparse.ArgumentParser(add_help=False)
    scale_options(pre)
    known, rest = pre.parse_known_args(argv)
    refusal = f"--scales: lr factors in (0, 1], e.g. 1,0.5; got {known.scales!r}"
    scales = float_list(known.scales, lambda scale: 0 < scale <= 1, refusal)
    return scales, known.modes.split(","), known.gate_only, rest


def main(argv: list[str] | None = None) -> list[ScaledVerdict]:
    scales, modes, gate_only, rest = scales_and_modes(argv)
    scoring = scoring_arguments(
        __doc__ or "", rest, default=tuple(TASKS), more_options=scale_options, known=ALL_TASKS
    )
    print(f"the gate at {scoring.trial_steps} steps with the recipe's lr scaled; truth at 1x")
    rows = []
    for name in scoring.names:
        for row in task_verdicts(name, scoring, scales, modes, gate_only):
            rows.append(row)
            gate_said = "accept" if row.accepted else "reject"
            truth = {True: "hurts", False: "fine", None: "-"}[row.truth_hurts]
            reason = row.reasons[0][:70] if row.reasons else ""
            print(
                f"{row.task:18} {row.label:22} x{row.scale:<5g} {gate_said:6} {truth:5}  "
                f"movement {row.movement:6.3f}  {reason}",
                flush=True,
            )
    print()
    for scale, (false_accepts, false_rejects, pairs) in errors_by_scale(rows).items():
        print(
            f"lr x{scale:g}: {false_accepts} false accept(s), {false_rejects} false reject(s) "
            f"over {pairs} pairs"
        )
    return rows


if __name__ == "__main__":
    main()
