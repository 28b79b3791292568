"""Does pure bf16 lose its updates later in a run? The movement check, taken at later steps.

The gate's movement check compares how far a trial's weights move with fp32's over the trial's
first 200 steps. Pure bf16 rounded to nearest loses an update smaller than half an ulp of its
weight; Adam's steps shrink as gradients turn to noise late in a run, so a trial at the start
may see updates arrive that later would not. This benchmark measures it: it trains a task in
fp32 (its recipe and schedule, seed 0) and, at each checkpoint, continues a copy for a window of
steps in fp32 and another in pure bf16 (the same weights cast to bf16, the same optimizer state,
the same batches, the lr the schedule has reached held for the window). Printed: the projection
of pure bf16's movement over the window onto fp32's (1: all of it arrived; the gate's bar is
0.8), and the share of weights fp32 moved that pure bf16 never moved.

    python -m benchmarks.late_movement [--tasks a,b] [--steps 2000] [--threads 1]
    python -m benchmarks.late_movement --tasks recommender    # a held-out task (any of them)
    python -m benchmarks.late_movement --quick    # the conv net, 300 steps: the CI variant
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch

from autoprec.batching import forward_and_loss
from autoprec.errors import OptimizerRebuiltWarning
from autoprec.plan import PrecisionPlan, prepare
from autoprec.specs import ModeSpec
from benchmarks.ground_truth import ALL_TASKS, run_arguments
from benchmarks.ground_truth_tasks import GroundTask

WINDOW = 100
"""Optimizer steps each continuation runs from a checkpoint."""
CHECKPOINTS = (0, 200, 500, 1000, 1500)
DEFAULT_TASKS = ("digits_convnet", "nanogpt_recipe", "cosine_regression")
"""Pure bf16 hurts on the conv net and the gate accepts it with beta2 0.95; on nanoGPT's recipe
it is fine; on the cosine run it hurts and the movement check catches it at the floor lr."""


@dataclass(frozen=True)
class Window:
    step: int
    lr: float
    fraction: float
    """Projection of pure bf16's movement over the window onto fp32's movement."""
    never_moved: float
    """Share of the weights fp32 moved that pure bf16 never moved."""


def make_plan(
    spec: ModeSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> PrecisionPlan:
    with warnings.catch_warnings():  # the rebuilt-optimizer warning: no scheduler to rebind
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        return prepare(spec, model, optimizer)


def train_on(plan: PrecisionPlan, task: GroundTask, batches: list[int]) -> None:
    for index in batches:
        with plan.autocast():
            loss, _ = forward_and_loss(plan, task.batches[index], task.recipe.loss_fn)
        plan.step(loss, clip_grad_norm=task.recipe.clip_grad_norm)


def _weights(plan: PrecisionPlan) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in plan.model.parameters()])


def continue_both(plan: PrecisionPlan, task: GroundTask, step: int, batches: list[int]) -> Window:
    """From ``plan``'s fp32 state: ``batches`` in fp32 and in pure bf16, compared."""
    runs = {}
    for mode in ("fp32", "bf16_pure"):
        model = copy.deepcopy(plan.model)
        optimizer = task.recipe.make_optimizer(task.model, model)
        continued = make_plan(ModeSpec(mode=mode), model, optimizer)
        # a copy of the run's moments and step counts (an fp32 load would share the run's
        # tensors); torch casts them to bf16 for bf16 parameters
        continued.optimizer.load_state_dict(copy.deepcopy(plan.optimizer.state_dict()))
        start = _weights(continued)
        train_on(continued, task, batches)
        runs[mode] = (start, _weights(continued))
    (fp32_start, fp32_end), (bf16_start, bf16_end) = runs["fp32"], runs["bf16_pure"]
    reference, trial = fp32_end - fp32_start, bf16_end - bf16_start
    moved = reference != 0
    return Window(
        step=step,
        lr=float(plan.optimizer.param_groups[0]["lr"]),
        fraction=float(trial @ reference / (reference @ reference)),
        never_moved=float(((trial == 0) & moved).sum() / moved.sum().clamp(min=1)),
    )


def measure(name: str, steps: int) -> list[Window]:
    """The task's fp32 run, continued from each checkpoint below ``steps`` both ways."""
    torch.manual_seed(0)
    task = ALL_TASKS[name](steps)
    model = copy.deepcopy(task.model)
    optimizer = task.recipe.make_optimizer(task.model, model)
    scheduler = task.recipe.make_scheduler(optimizer)
    plan = make_plan(ModeSpec(mode="fp32"), model, optimizer)
    order = torch.randperm(len(task.batches), generator=torch.Generator().manual_seed(0))
    windows = []
    for step in range(steps):
        if step in CHECKPOINTS:
            following = [int(order[(step + k) % len(order)]) for k in range(WINDOW)]
            with torch.random.fork_rng():
                windows.append(continue_both(plan, task, step, following))
        train_on(plan, task, [int(order[step % len(order)])])
        if scheduler is not None:
            scheduler.step()
    return windows


def main(argv: list[str] | None = None) -> dict[str, list[Window]]:
    names, steps, _ = run_arguments(
        __doc__,
        argv,
        default=DEFAULT_TASKS,
        quick=["digits_convnet"],
        quick_steps=300,
        known=ALL_TASKS,
    )
    print(f"pure bf16's movement over {WINDOW} steps from each checkpoint of an fp32 run, as a")
    print("share of fp32's from the same state (never moved: of the weights fp32 moved)")
    results = {}
    for name in names:
        results[name] = measure(name, steps)
        for window in results[name]:
            print(
                f"{name:18} step {window.step:5}  lr {window.lr:8.2g}  movement "
                f"{window.fraction:6.3f}  never moved {window.never_moved:6.1%}",
                flush=True,
            )
    return results


if __name__ == "__main__":
    main()
