"""Progress events of a tune() or check() run, and the sink that sends them to a display."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel

from autoprec._models import FROZEN_RECORD
from autoprec.outcomes import TrialOutcome
from autoprec.trial_records import StopCheck, TrialProgress, measured_windows

EventKind = Literal["phase", "start", "step", "done", "skip"]

STEP_EVENT_SECONDS = 1.0
"""A "step" event goes out at most once a second of the tune's clock (and at a trial's last
step): displays stay live without a callback on every step."""


class SearchEvent(BaseModel):
    """Progress of a ``tune()`` run, for displays: ``tune(on_event=callback)`` gets every one.

    ``kind`` is one of:

    - ``"phase"``: work outside a candidate's trial (``label``: "calibration (fp32)", "fp32
      reference", "fp32 noise run", "fp32 paired noise run", "re-timing <mode label>"), with
      ``steps`` planned;
    - ``"start"``: candidate ``index`` of ``total`` (``label``) starts;
    - ``"step"``: ``step`` of ``steps`` optimizer steps done in the current phase or trial;
    - ``"done"``: the candidate ended; ``outcome`` holds its status, figures and reasons;
    - ``"skip"``: the candidate was not run: finished in an earlier run of the same study, or
      no time left (``outcome`` says which).

    Times count from the start of ``tune()``, so ``remaining_seconds`` is the whole budget's.
    """

    model_config = FROZEN_RECORD

    kind: EventKind
    index: int
    total: int
    label: str
    elapsed_seconds: float
    budget_seconds: float
    best: str | None = None
    outcome: TrialOutcome | None = None
    step: int | None = None
    steps: int | None = None
    step_seconds: float | None = None
    """``"step"`` events: the current trial's or phase's pace so far, the median step of its
    timed windows, or before any its fastest warm-up pass (an eager run); None before either."""

    @property
    def remaining_seconds(self) -> float:
        return max(self.budget_seconds - self.elapsed_seconds, 0.0)

    @property
    def in_search(self) -> bool:
        """A candidate's event (not the reference work before the search)."""
        return self.kind != "phase" and self.index >= 0


class EventSink:
    """Sends :class:`SearchEvent`s to ``on_event`` with times counted from ``started``."""

    def __init__(
        self,
        on_event: Callable[[SearchEvent], None] | None,
        *,
        started: float,
        budget_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.on_event = on_event
        self.started = started
        self.budget_seconds = budget_seconds
        self.clock = clock

    def emit(
        self,
        kind: EventKind,
        label: str,
        *,
        index: int = -1,
        total: int = 0,
        best: str | None = None,
        outcome: TrialOutcome | None = None,
        step: int | None = None,
        steps: int | None = None,
        step_seconds: float | None = None,
    ) -> None:
        if self.on_event is None:
            return
        self.on_event(
            SearchEvent(
                kind=kind,
                index=index,
                total=total,
                label=label,
                elapsed_seconds=self.clock() - self.started,
                budget_seconds=self.budget_seconds,
                best=best,
                outcome=outcome,
                step=step,
                steps=steps,
                step_seconds=step_seconds,
            )
        )

    def watch(
        self,
        stop: StopCheck | None,
        label: str,
        *,
        index: int = -1,
        total: int = 0,
        best: str | None = None,
    ) -> StopCheck | None:
        """``stop`` wrapped to also send "step" events (no host sync: it reads the step count
        and the clock only)."""
        if self.on_event is None:
            return stop
        last = [-float("inf")]

        def check(progress: TrialProgress) -> str | None:
            now = self.clock()
            done = progress.step + 1
            if now - last[0] >= STEP_EVENT_SECONDS or done == progress.steps_planned:
                last[0] = now
                self.emit(
                    "step",
                    label,
                    index=index,
                    total=total,
                    best=best,
                    step=done,
                    steps=progress.steps_planned,
                    step_seconds=pace(progress),
                )
            return None if stop is None else stop(progress)

        return check


def pace(progress: TrialProgress) -> float | None:
    """Seconds per step so far (see ``SearchEvent.step_seconds``)."""
    measured = measured_windows(progress.windows)
    if measured:
        return statistics.median(window.step_seconds for window in measured)
    return min(progress.pass_seconds) if progress.pass_seconds else None
