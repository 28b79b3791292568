"""What Python's garbage collector costs a tune() in a process that holds many objects.

A full collection walks every tracked object of the process; a tune makes enough objects to
start several. This benchmark holds ``--objects`` small dicts beside the run (what a notebook
with a dataset read into Python lists holds), then tunes ``examples.tiny_gpt`` twice with the
same budget: as autoprec runs it (the caller's objects frozen out of the walks,
``autoprec.collector``) and with that freezing turned off. For each it prints the wall time
against the budget, the full collections run and the seconds they took (timed with
``gc.callbacks``), the chosen mode and each run's median step time. The backends tune imports
on first use are imported before either arm, so neither walks them alone.

    python -m benchmarks.gc_pauses [--objects 1500000] [--budget 0.25]
    python -m benchmarks.gc_pauses --quick    # 300000 objects, one candidate, 0.3 minutes: CI
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import autoprec
from autoprec import run_inputs
from autoprec._imports import BACKENDS, is_installed, require
from examples import tiny_gpt


@dataclass
class CollectionTimes:
    """Seconds spent in the collector, by generation, while it is installed."""

    seconds: dict[int, float] = field(default_factory=lambda: {0: 0.0, 1: 0.0, 2: 0.0})
    full_collections: int = 0
    _started: float = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds[info["generation"]] += time.perf_counter() - self._started
        self.full_collections += info["generation"] == 2


@contextlib.contextmanager
def timed_collections() -> Iterator[CollectionTimes]:
    times = CollectionTimes()
    gc.callbacks.append(times)
    try:
        yield times
    finally:
        gc.callbacks.remove(times)


@dataclass(frozen=True)
class Run:
    frozen: bool
    wall_seconds: float
    budget_seconds: float
    full_collections: int
    collection_seconds: float
    chosen: str
    step_ms: dict[str, float]


def tune_once(frozen: bool, budget_minutes: float, modes: list[str] | None = None) -> Run:
    model, _ = tiny_gpt.make_model()
    batches = tiny_gpt.make_batches(count=16)
    off = contextlib.nullcontext
    patches = (
        contextlib.ExitStack()
        if frozen
        else mock.patch.multiple(run_inputs, callers_objects_frozen=off)
    )
    with patches, timed_collections() as times:
        start = time.monotonic()
        result = autoprec.tune(
            model, batches, budget_minutes=budget_minutes, modes=modes, progress=False
        )
        wall = time.monotonic() - start
    step_ms = {
        outcome.label: outcome.median_step_seconds * 1e3
        for outcome in (result.reference, *result.trials)
        if outcome.median_step_seconds
    }
    return Run(
        frozen,
        wall,
        budget_minutes * 60,
        times.full_collections,
        times.seconds[2],
        result.chosen.mode,
        step_ms,
    )


def main(argv: list[str] | None = None) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=1_500_000)
    parser.add_argument("--budget", type=float, default=0.25, help="minutes per tune")
    parser.add_argument(
        "--quick", action="store_true", help="300000 objects, one candidate, 0.3 minutes: CI"
    )
    args = parser.parse_args(argv)
    objects, budget = (300_000, 0.3) if args.quick else (args.objects, args.budget)
    # --quick: fp32 with 8-bit states alone (fast on any CPU). With every candidate, 0.15
    # minutes was refused as too small when a loaded CI machine's fp32 step took 0.0365 s
    # (10 runs of 20 steps: 0.40 minutes at least)
    modes = ["fp32+8bit-optim"] if args.quick else None
    import optuna  # noqa: F401 - what tune imports on first use, imported before either arm

    for name in BACKENDS:
        if is_installed(name):
            require(name)
    held = [{"value": [index]} for index in range(objects)]
    print(f"tiny_gpt, budget {budget:g} min, {len(held)} objects held beside the run")
    runs = [tune_once(frozen, budget, modes) for frozen in (True, False)]
    for run in runs:
        steps = ", ".join(f"{label} {ms:.1f}" for label, ms in run.step_ms.items())
        print(
            f"callers' objects {'frozen' if run.frozen else 'walked'}: "
            f"wall {run.wall_seconds:.2f} s of {run.budget_seconds:.0f} s; "
            f"{run.full_collections} full collections took "
            f"{run.collection_seconds:.2f} s; chose {run.chosen}\n  median step ms: {steps}"
        )
    del held
    return runs


if __name__ == "__main__":
    main()
