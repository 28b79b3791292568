"""Scripts that print figures: run them as `python -m benchmarks.NAME`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from autoprec.collector import callers_objects_frozen

P = ParamSpec("P")
R = TypeVar("R")


def objects_frozen(main: Callable[P, R]) -> Callable[P, R]:
    """Run a benchmark's ``main`` as ``tune()`` and ``check()`` run: every object alive at its
    start (torch, transformers and the rest imported) frozen out of the collector's full walks
    (``autoprec.collector``). A benchmark that calls ``run_trial`` or the screen directly
    otherwise pays two walks of the whole process a trial, and times the mode as no tune does:
    ``threshold_sweep --quick`` on the digits MLP spent 14.6 s of its 23.8 s in them (34
    collections of 0.43 s, after the ground truth's run in the same process)."""

    @functools.wraps(main)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with callers_objects_frozen():
            return main(*args, **kwargs)

    return run
