"""What the small seeded-run benchmarks share: their command line, a regression MLP whose
weights each seed draws anew (``state_rounding_optimizers``, ``ema_rounding``), and a run
through ``autoprec.prepare`` scored on held-out batches (``running_state_rounding``,
``spectral_norm_rounding``)."""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import autoprec
from autoprec.errors import OptimizerRebuiltWarning
from examples import tasks

HELDOUT = 8
"""Batches at the end of the list that no step sees."""


def prepared_run(
    spec: autoprec.ModeSpec,
    model: nn.Module,
    batches: list[Any],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    seed: int,
    steps: int,
) -> tuple[float, autoprec.PrecisionPlan]:
    """Train ``model`` in ``spec`` through ``autoprec.prepare`` with AdamW (lr 1e-3), ``steps``
    steps on (x, y) batches drawn at random (``seed``) from all but the last ``HELDOUT``;
    return the mean loss over those (eval mode, the mode's autocast) and the plan."""
    train, heldout = batches[:-HELDOUT], batches[-HELDOUT:]
    with warnings.catch_warnings():  # no scheduler to rebind: plan.optimizer is stepped
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        plan = autoprec.prepare(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    order = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = train[int(torch.randint(0, len(train), (1,), generator=order))]
        with plan.autocast():
            loss = loss_fn(plan.model(x), y)
        plan.step(loss)
    plan.model.eval()
    with torch.no_grad(), plan.autocast():
        losses = [float(loss_fn(plan.model(x), y)) for x, y in heldout]
    return statistics.mean(losses), plan


def run_arguments(
    doc: str,
    argv: list[str] | None,
    *,
    steps: int,
    seeds: int,
    quick: tuple[int, int],
    add: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[argparse.Namespace, int, int]:
    """(arguments, steps, seeds) from ``--steps``, ``--seeds``, ``--quick`` (``quick``'s steps
    and seeds: the CI variant), ``--threads`` (set for torch) and whatever ``add`` adds."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--seeds", type=int, default=seeds)
    parser.add_argument(
        "--quick", action="store_true", help=f"{quick[0]} steps, {quick[1]} seed(s) (CI)"
    )
    parser.add_argument("--threads", type=int, default=1)
    if add is not None:
        add(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args, *(quick if args.quick else (args.steps, args.seeds))


def seeded_regression(seed: int) -> tasks.Task:
    """``examples.tasks.regression`` (60 batches) with its matrices drawn again from ``seed``."""
    task = tasks.regression(batches=60)
    torch.manual_seed(seed)
    for parameter in task.model.parameters():
        if parameter.dim() > 1:
            nn.init.normal_(parameter, 0.0, 0.3 / parameter.shape[1] ** 0.5)
    return task
