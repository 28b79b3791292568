"""Where does emulated FP8's cost on a task come from: the trained weights, or the FP8 forward?

The ground truth's one false accept is emulated FP8 (torchao, tensorwise) on the cosine run:
+2.1% test loss at 2000 steps, measured as the truth measures every mode, in its own precision.
This benchmark trains fp32 and the gate's FP8 spec at the same seeds (same batches and draws)
and evaluates each trained model twice, with an fp32 forward and with an FP8 forward, so the
cost splits into training (FP8-trained weights read in fp32) and evaluation (the FP8 forward).
Then it asks whether a longer trial would have seen it: the gate's verdict on the FP8 spec at
``--check-steps`` trial lengths, with its held-out loss gap and noise floor.

    python -m benchmarks.fp8_cost_split [--tasks cosine_regression] [--steps 2000] [--threads 1]
    python -m benchmarks.fp8_cost_split --quick    # 1 seed, 300 steps, a 30-step check: CI
"""

from __future__ import annotations

import copy
import statistics
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from autoprec.plan import PrecisionPlan, prepare
from autoprec.specs import ModeSpec
from benchmarks.ground_truth import chosen_tasks, gate, long_run, task_parser
from benchmarks.ground_truth_tasks import TASKS, GroundTask

SEEDS = 3


@dataclass(frozen=True)
class CostSplit:
    """Test metrics of one seed: ``<weights>_<forward>`` (fp32 or fp8 each)."""

    seed: int
    fp32_fp32: float
    fp32_fp8: float
    fp8_fp32: float
    fp8_fp8: float


def fp8_spec(task: GroundTask) -> ModeSpec:
    """The FP8 spec ``autoprec.check()`` screens on this task (its layers kept out of FP8)."""
    verdicts = gate(task, 20, ["fp8_torchao"]).verdicts
    return next(v.spec for v in verdicts if v.spec.optimizer_bits == 32)


def fp32_copy(task: GroundTask, plan: PrecisionPlan) -> nn.Module:
    """The task's fp32 model holding the plan's trained weights (FP8 swaps keep their names)."""
    model = copy.deepcopy(task.model)
    trained = plan.model.state_dict()
    model.load_state_dict({name: trained[name].float() for name in model.state_dict()})
    return model


def metric_with(task: GroundTask, weights: nn.Module, spec: ModeSpec) -> float:
    model = copy.deepcopy(weights)
    with warnings.catch_warnings():  # a fresh optimizer: nothing steps, nothing to rebind
        warnings.simplefilter("ignore")
        plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    return task.metric(plan)


def split(task: GroundTask, fp8: ModeSpec, seed: int, steps: int) -> CostSplit:
    fp32 = ModeSpec(mode="fp32")
    plans: dict[str, PrecisionPlan] = {}
    for name, spec in (("fp32", fp32), ("fp8", fp8)):
        long_run(task, spec, seed, steps, lambda plan, name=name: plans.__setitem__(name, plan))
    trained = {name: fp32_copy(task, plan) for name, plan in plans.items()}
    return CostSplit(
        seed,
        fp32_fp32=metric_with(task, trained["fp32"], fp32),
        fp32_fp8=metric_with(task, trained["fp32"], fp8),
        fp8_fp32=metric_with(task, trained["fp8"], fp32),
        fp8_fp8=metric_with(task, trained["fp8"], fp8),
    )


def gate_at(task: GroundTask, fp8: ModeSpec, steps: int, final: float) -> str:
    """The gate's verdict on ``fp8`` after a ``steps``-step trial, with the figures its loss
    check compares (the held-out gap against 3 noise floors) and its forward cost: over the
    trial's own held-out loss (what the gate judges) and, in absolute terms, over ``final``,
    the fp32 run's final test metric (what a gate told the loss a run ends at could judge)."""
    (verdict,) = [v for v in gate(task, steps, ["fp8_torchao"]).verdicts if v.spec == fp8]
    gap, floor = verdict.drift["heldout_loss_gap"], verdict.drift["noise_floor"]
    cost, absolute = verdict.drift.get("forward_cost"), verdict.drift.get("forward_cost_absolute")
    forward = (
        ""
        if cost is None or absolute is None
        else f"; forward cost {cost:+.3%} of the trial's loss, {absolute / abs(final):+.3%} of "
        "fp32's final metric"
    )
    return f"{verdict.status} (held-out gap {gap:.5f}, noise floor {floor:.5f}{forward})"


def print_costs(rows: list[CostSplit]) -> None:
    """Each way of reading a model, over the fp32 weights read in fp32 (means over ``rows``,
    one task's seeds)."""
    base = statistics.fmean(r.fp32_fp32 for r in rows)
    for label, field in (
        ("FP8 forward on fp32 weights", "fp32_fp8"),
        ("FP8-trained weights, fp32 forward", "fp8_fp32"),
        ("FP8-trained weights, FP8 forward", "fp8_fp8"),
    ):
        mean = statistics.fmean(getattr(r, field) for r in rows)
        print(f"  {label:34} {mean / base - 1:+.2%} over fp32 (mean of {len(rows)} seeds)")


def main(argv: list[str] | None = None) -> list[CostSplit]:
    parser = task_parser(__doc__, quick="1 seed, 300 steps (CI)", default="cosine_regression")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--check-steps", default="200,1000,2000", help="trial lengths to judge")
    args = parser.parse_args(argv)
    names = chosen_tasks(parser, args, default=["cosine_regression"], quick=["cosine_regression"])
    steps, seeds = (300, 1) if args.quick else (args.steps, SEEDS)
    check_steps = [30] if args.quick else [int(n) for n in args.check_steps.split(",")]
    rows: list[CostSplit] = []
    for name in names:
        task = TASKS[name](steps)
        fp8 = fp8_spec(task)
        print(f"{name}, {steps} steps, {fp8.label}: test metric by weights / forward", flush=True)
        task_rows = [split(task, fp8, seed, steps) for seed in range(seeds)]
        for row in task_rows:
            print(
                f"  seed {row.seed}: fp32 weights {row.fp32_fp32:.6f} / fp8 forward "
                f"{row.fp32_fp8:.6f}   fp8 weights fp32 forward {row.fp8_fp32:.6f} / "
                f"fp8 forward {row.fp8_fp8:.6f}"
            )
        print_costs(task_rows)
        final = statistics.fmean(row.fp32_fp32 for row in task_rows)
        for trial_steps in check_steps:
            verdict = gate_at(task, fp8, trial_steps, final)
            print(f"  the gate after a {trial_steps}-step trial: {verdict}")
        rows += task_rows
    return rows


if __name__ == "__main__":
    main()
