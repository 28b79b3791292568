"""What the small seeded-run benchmarks share: their command line and a regression MLP whose
weights each seed draws anew (``state_rounding_optimizers``, ``ema_rounding``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

from examples import tasks


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
