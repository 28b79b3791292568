"""check()'s optional time limit on one mode's trial (``max_trial_minutes``).

check() has no budget: it answers the quality question for every mode, whatever its speed.
Where a mode has no fast kernels it can take very long (on a CPU, amp_fp16's step of
``examples.small_convnet`` took 15-17 s against fp32's 0.11-0.19 s: about 50 minutes for 200
steps). With a limit, a trial stops once it has taken longer, or once its pace says it would:
from two timings on (warm-up passes or timed windows), since one may be a stall (a 2.8 s first
step of a 10 ms one was seen on a busy machine). The stopped mode is reported as not judged.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from autoprec.search_events import pace
from autoprec.trial_records import StopCheck, TrialProgress, measured_windows


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.3g} min"


def time_limit(
    limit_minutes: float | None, clock: Callable[[], float] = time.monotonic
) -> StopCheck | None:
    """A stop check for one trial, started now: None without a limit."""
    if limit_minutes is None:
        return None
    limit, started = 60 * limit_minutes, clock()
    way_out = (
        f"over max_trial_minutes={limit_minutes:g}: check it where it runs fast, or raise the "
        "limit (max_trial_minutes= in Python, --max-trial-minutes on the command line)"
    )

    def stop(progress: TrialProgress) -> str | None:
        elapsed = clock() - started
        done = progress.step + 1
        if elapsed > limit:
            return f"stopped after {_minutes(elapsed)} and {done} steps, {way_out}"
        per_step = pace(progress)
        timings = len(measured_windows(progress.windows)) or len(progress.pass_seconds)
        if per_step is None or timings < 2:
            return None
        projected = elapsed + (progress.steps_planned - done) * per_step
        if projected <= limit:
            return None
        return (
            f"stopped after {done} of {progress.steps_planned} steps: at {per_step:.3g} s a step "
            f"the trial would take about {_minutes(projected)} here, {way_out}"
        )

    return stop
