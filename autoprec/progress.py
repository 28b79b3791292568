"""Live progress of a tune run: a status line that updates in place on an interactive terminal,
plain lines where output goes to a log or a pipe. Used by the CLI and by ``tune(progress=True)``.
"""

from __future__ import annotations

from rich.console import Console
from rich.live import Live
from rich.text import Text

from autoprec.outcomes import TrialOutcome
from autoprec.search_events import SearchEvent

PLAIN_STEP_SECONDS = 15.0
"""Without a live terminal, a trial's step count is printed at most every 15 s of the budget:
a CI log shows a long trial moving without one line per second."""

STATUS_STYLE = {
    "accepted": "green",
    "rejected": "red",
    "pruned": "yellow",
    "failed": "red",
    "stopped": "yellow",
}


def interactive(console: Console | None = None) -> bool:
    """True in an interactive terminal or a notebook: where progress is shown by default."""
    console = console or Console(stderr=True)
    return console.is_terminal or console.is_jupyter


def _seconds(value: float) -> str:
    value = max(value, 0.0)
    if round(value) < 100:  # as printed: 99.6 read "100 s", 100.2 "1:40" (a hunt)
        return f"{value:.0f} s"
    minutes, seconds = divmod(round(value), 60)
    return f"{minutes}:{seconds:02d}"


def status_line(event: SearchEvent) -> str:
    """One line: what runs, its step count, the budget's elapsed and remaining time, the best."""
    if event.in_search:
        what = f"trial {event.index + 1}/{event.total} {event.label}"
    else:
        what = event.label
    parts = [what]
    if event.step is not None and event.steps:
        parts.append(f"step {event.step}/{event.steps}")
    elif event.steps:
        parts.append(f"{event.steps} steps")
    if event.budget_seconds > 0:
        parts.append(
            f"{_seconds(event.elapsed_seconds)} of {_seconds(event.budget_seconds)}, "
            f"{_seconds(event.remaining_seconds)} left"
        )
    else:  # no budget (autoprec check): this trial's pace and time to go, time so far
        parts.extend(_to_go(event))
        parts.append(f"{_seconds(event.elapsed_seconds)} elapsed")
    if event.in_search and event.best is not None:
        parts.append(f"best {event.best}")
    return " · ".join(parts)


def _to_go(event: SearchEvent) -> list[str]:
    """Without a budget nothing bounds a trial, and a mode can be very slow where it has no
    fast kernels (on a CPU amp_fp16's step of ``examples.small_convnet`` took 15-17 s, fp32's
    0.11-0.19 s: about 50 minutes for check()'s 200 steps), so the line says so as soon as the
    first warm-up pass is timed."""
    if event.step_seconds is None or event.step is None or not event.steps:
        return []
    per_step, remaining = event.step_seconds, event.steps - event.step
    rate = f"{per_step:.2g} s/step" if per_step < 10 else f"{_seconds(per_step)}/step"
    return [f"{rate}, ~{_seconds(remaining * per_step)} to go" if remaining > 0 else rate]


SCREEN_WORDS = {"accepted": "safe", "rejected": "unsafe"}
"""How the quality screen (``check``) names the gate's verdicts: its report says safe/unsafe,
its progress said tune's accepted/rejected (found by a hunt)."""


def outcome_line(outcome: TrialOutcome, *, earlier: bool = False, screen: bool = False) -> Text:
    """A finished trial in one line: label, status (in the screen's words for ``check``),
    speed or the first reason."""
    shown = SCREEN_WORDS.get(outcome.status, outcome.status) if screen else outcome.status
    line = Text.assemble((f"{outcome.label} ", "bold"), (shown, STATUS_STYLE[outcome.status]))
    if earlier:
        line.append(" (from the study)", style="dim")
    if outcome.status == "accepted" and outcome.samples_per_second:
        line.append(f" {outcome.samples_per_second:,.1f} samples/s")
    elif outcome.reasons:
        line.append(f": {outcome.reasons[0]}")
    return line


class TuneProgress:
    """An ``on_event`` callback that shows a tune run's progress on ``console`` (stderr).

    Live (an interactive terminal or notebook): one status line updated in place, each finished
    trial printed above it. Plain (a log, a pipe): a line when a phase or trial starts, its step
    count every ``PLAIN_STEP_SECONDS``, a line when it ends.
    """

    def __init__(
        self, console: Console | None = None, *, live: bool | None = None, screen: bool = False
    ) -> None:
        self.console = console or Console(stderr=True)
        self.screen = screen
        """A quality screen's progress (``check``): verdicts as safe/unsafe."""
        self.live = interactive(self.console) if live is None else live
        self._display: Live | None = None
        self._last_plain = -float("inf")

    def __enter__(self) -> TuneProgress:
        if self.live:
            self._display = Live(
                Text("starting: reading batches, probing the model..."),
                console=self.console,
                refresh_per_second=4,
                transient=True,
            )
            self._display.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._display is not None:
            self._display.__exit__(*exc)  # type: ignore[arg-type]
            self._display = None

    def _print(self, line: Text) -> None:
        self.console.print(line, no_wrap=True, overflow="ellipsis")

    def __call__(self, event: SearchEvent) -> None:
        if event.kind in ("done", "skip") and event.outcome is not None:
            earlier = event.kind == "skip" and event.outcome.seconds > 0
            self._print(outcome_line(event.outcome, earlier=earlier, screen=self.screen))
        status = status_line(event)
        if self._display is not None:
            self._display.update(Text(status, no_wrap=True, overflow="ellipsis"))
            return
        plain_step = (
            event.kind == "step" and event.elapsed_seconds - self._last_plain >= PLAIN_STEP_SECONDS
        )
        if event.kind in ("phase", "start") or plain_step:
            self._last_plain = event.elapsed_seconds
            self._print(Text(status))
