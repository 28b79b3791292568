"""Does pure bf16 lose its updates later in a run? The movement check, taken at later steps.

The gate's movement check compares how far a trial's weights move with fp32's over the trial's
first 200 steps. Pure bf16 rounded to nearest loses an update smaller than half an ulp of its
weight; Adam's steps shrink as gradients turn to noise late in a run, so a trial at the start
may see updates arrive that later would not. This benchmark measures it: it trains a task in
fp32 (its recipe and schedule, seed 0) and, at each checkpoint, continues a copy for a window of
steps in fp32 and another in pure bf16 as ``check()`` builds it (the same weights, cast to bf16
but for the norms and embeddings it keeps in fp32; the same optimizer state, batches and random
draws; the lr the schedule has reached held for the window), and a third in fp32 from weights
nudged by 2^-12, the ceiling (what faithful fp32 reaches: below 1 where training is chaotic,
as with dropout; the gate judges a trial against such a run). Printed: the projection of pure
bf16's movement over the window onto fp32's, and over the ceiling (1: all of it arrived; the
gate's bar is 0.8 of its paired run's), the share of weights fp32 moved that pure bf16 never
moved, and the parameter tensor whose share over its own ceiling is the smallest (a small
layer's loss hides in the pooled figure).

    python -m benchmarks.late_movement [--tasks a,b] [--steps 2000] [--threads 1]
    python -m benchmarks.late_movement --tasks recommender    # a held-out task (any of them)
    python -m benchmarks.late_movement --quick    # the conv net, 300 steps: the CI variant
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass

import torch

from autoprec.batching import forward_and_loss
from autoprec.drift_movement import MIN_PAIRED_MOVEMENT, _movement
from autoprec.errors import OptimizerRebuiltWarning
from autoprec.model_copies import nudge_weights
from autoprec.plan import PrecisionPlan, prepare
from autoprec.specs import ModeSpec
from benchmarks.ground_truth import ALL_TASKS, run_arguments
from benchmarks.ground_truth_tasks import GroundTask
from benchmarks.truth_power import specs_by_label

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
    ceiling: float
    """The same projection for fp32 continued from weights nudged by 2^-12, with the same
    draws: what faithful fp32 reaches (below 1 where training is chaotic, as with dropout);
    the gate judges a trial against such a run."""
    weakest: str
    """The parameter whose projection, over its own ceiling, is the smallest (the pooled one can
    hide a small layer: the recommender's MLP head is 2.2k of its 22k weights)."""
    weakest_share: float
    """That parameter's projection over its ceiling."""

    @property
    def share(self) -> float:
        """Pure bf16's projection over the ceiling: what the gate's movement check reads."""
        return self.fraction / self.ceiling


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


def _weights(plan: PrecisionPlan) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().flatten().clone() for name, p in plan.model.named_parameters()}


Run = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
"""A continuation's weights at its start and at its end, by parameter name."""


def _pooled(run: Run, reference: Run, names: list[str] | None = None) -> tuple[float, float]:
    """(projection of ``run``'s movement onto ``reference``'s, share of the weights the reference
    moved that ``run`` never moved) over ``names`` (default: every weight), by the gate's own
    arithmetic (``drift_movement._movement``); nan where the reference did not move them."""
    (start, end), (reference_start, reference_end) = run, reference
    names = list(reference_start) if names is None else names
    found = _movement(end, start, reference_end, reference_start, names)
    return found if found is not None else (math.nan, math.nan)


def _weakest(trial: Run, reference: Run, nudged: Run) -> tuple[str, float]:
    """(name, projection over the nudged run's) of the parameter whose movement arrived least,
    among those fp32 moved and the nudged run follows (a projection of at least
    ``MIN_PAIRED_MOVEMENT``, the gate's own limit for judging movement); ("-", nan) when none."""
    shares = []
    for name in reference[0]:
        ceiling, _ = _pooled(nudged, reference, [name])
        if ceiling >= MIN_PAIRED_MOVEMENT:  # nan (fp32 did not move it) compares false
            shares.append((name, _pooled(trial, reference, [name])[0] / ceiling))
    return min(shares, key=lambda item: item[1]) if shares else ("-", float("nan"))


def continue_both(
    plan: PrecisionPlan, task: GroundTask, step: int, batches: list[int], pure: ModeSpec
) -> Window:
    """From ``plan``'s fp32 state: ``batches`` in fp32, in fp32 from weights nudged by 2^-12,
    and in ``pure`` (pure bf16 as ``check()`` builds it, norms and embeddings kept fp32),
    compared. Every continuation draws the same random numbers (dropout masks), as the gate's
    trials draw the reference's."""
    runs: dict[str, Run] = {}
    draws = torch.get_rng_state()
    fp32 = ModeSpec(mode="fp32")
    for mode, spec in (("fp32", fp32), ("nudged", fp32), ("bf16_pure", pure)):
        torch.set_rng_state(draws)
        model = copy.deepcopy(plan.model)
        if mode == "nudged":
            nudge_weights(model, seed=step)
        optimizer = task.recipe.make_optimizer(task.model, model)
        continued = make_plan(spec, model, optimizer)
        # a copy of the run's moments and step counts (an fp32 load would share the run's
        # tensors); torch casts them to bf16 for bf16 parameters
        continued.optimizer.load_state_dict(copy.deepcopy(plan.optimizer.state_dict()))
        start = _weights(continued)
        train_on(continued, task, batches)
        runs[mode] = (start, _weights(continued))
    weakest, weakest_share = _weakest(runs["bf16_pure"], runs["fp32"], runs["nudged"])
    fraction, never_moved = _pooled(runs["bf16_pure"], runs["fp32"])
    ceiling, _ = _pooled(runs["nudged"], runs["fp32"])
    return Window(
        step=step,
        lr=float(plan.optimizer.param_groups[0]["lr"]),
        fraction=fraction,
        never_moved=never_moved,
        ceiling=ceiling,
        weakest=weakest,
        weakest_share=weakest_share,
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
    pure = specs_by_label(task, ["bf16_pure"])[0]
    windows = []
    for step in range(steps):
        if step in CHECKPOINTS:
            following = [int(order[(step + k) % len(order)]) for k in range(WINDOW)]
            with torch.random.fork_rng():
                windows.append(continue_both(plan, task, step, following, pure))
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
    print("share of fp32's from the same state, and over the ceiling (fp32 from weights nudged by")
    print("2^-12, the same draws); never moved: of the weights fp32 moved; weakest: the tensor")
    print("with the smallest share over its own ceiling")
    results = {}
    for name in names:
        results[name] = measure(name, steps)
        for window in results[name]:
            print(
                f"{name:18} step {window.step:5}  lr {window.lr:8.2g}  movement "
                f"{window.fraction:6.3f} of ceiling {window.ceiling:6.3f} = {window.share:6.3f}  "
                f"never moved {window.never_moved:6.1%}  weakest {window.weakest} "
                f"{window.weakest_share:6.3f}",
                flush=True,
            )
    return results


if __name__ == "__main__":
    main()
