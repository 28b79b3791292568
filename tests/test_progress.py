"""Live progress: events from tune() and how the CLI and progress=True show them."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from autoprec.outcomes import TrialOutcome
from autoprec.progress import TuneProgress, status_line
from autoprec.search_events import EventSink, SearchEvent
from autoprec.specs import ModeSpec
from autoprec.trial_records import StepWindow, TrialProgress
from autoprec.tuning import tune
from examples import tiny_gpt


def event(kind: str, elapsed: float, **fields: object) -> SearchEvent:
    defaults: dict[str, object] = {
        "index": 1, "total": 9, "label": "bf16_pure+8bit-optim", "budget_seconds": 1800
    }  # fmt: skip
    return SearchEvent(
        kind=kind,  # type: ignore[arg-type]
        elapsed_seconds=elapsed,
        **{**defaults, **fields},  # type: ignore[arg-type]
    )


def test_status_line_has_step_budget_left_and_best() -> None:
    line = status_line(event("step", 754.0, step=40, steps=120, best="amp_bf16"))
    assert line == (
        "trial 2/9 bf16_pure+8bit-optim · step 40/120 · 12:34 of 30:00, 17:26 left · best amp_bf16"
    )
    phase = status_line(event("phase", 3.0, index=-1, label="fp32 reference", steps=120))
    assert phase == "fp32 reference · 120 steps · 3 s of 30:00, 29:57 left"


def test_without_a_budget_the_line_gives_the_trials_pace_and_time_to_go() -> None:
    """autoprec check has no budget: a trial's own pace is all that says how long it runs
    (amp_fp16 on a CPU conv net: 16 s a step, about 50 minutes for 200 steps)."""
    slow = event("step", 62.0, step=3, steps=200, step_seconds=16.0, budget_seconds=0.0)
    assert status_line(slow) == (
        "trial 2/9 bf16_pure+8bit-optim · step 3/200 · 16 s/step, ~52:32 to go · 62 s elapsed"
    )
    fast = event("step", 5.0, step=150, steps=200, step_seconds=0.0123, budget_seconds=0.0)
    assert "0.012 s/step, ~1 s to go · 5 s elapsed" in status_line(fast)
    done = event("step", 9.0, step=200, steps=200, step_seconds=0.04, budget_seconds=0.0)
    assert status_line(done).endswith("step 200/200 · 0.04 s/step · 9 s elapsed")
    unknown = event("step", 5.0, step=0, steps=200, budget_seconds=0.0)  # nothing timed yet
    assert status_line(unknown).endswith("step 0/200 · 5 s elapsed")
    # with a budget the line gives the budget's time instead (tune stops what cannot fit)
    assert "to go" not in status_line(event("step", 62.0, step=3, steps=200, step_seconds=16.0))


def test_step_events_carry_the_pace_from_passes_then_timed_windows() -> None:
    events: list[SearchEvent] = []
    clock = iter(range(100))
    sink = EventSink(events.append, started=0.0, budget_seconds=0.0, clock=lambda: next(clock))
    watch = sink.watch(None, "amp_fp16", index=0, total=1)
    assert watch is not None

    def window(first: int, seconds: float, warmup: bool = False) -> StepWindow:
        return StepWindow(
            first_step=first, steps=1, seconds=seconds, samples=8, tokens=None, warmup=warmup
        )

    def progress(step: int, windows: tuple, passes: tuple) -> TrialProgress:
        return TrialProgress(step, 200, windows, None, passes)

    watch(progress(-1, (), ()))  # before any pass: no pace
    watch(progress(-1, (), (16.5,)))  # the loss-scale pass
    warm = (window(0, 17.0, True), window(1, 15.5, True))
    watch(progress(1, warm, (16.5, 17.0, 15.5)))  # warm-up steps: the fastest pass
    timed = (*warm, window(2, 15.0), window(3, 16.0), window(4, 14.0))
    watch(progress(4, timed, (16.5, 17.0, 15.5)))  # timed windows: their median
    assert [e.step_seconds for e in events] == [None, 16.5, 15.5, 15.0]


def test_plain_progress_prints_starts_ends_and_a_step_line_every_15_s() -> None:
    out = io.StringIO()
    progress = TuneProgress(Console(file=out, width=80), live=False)
    outcome = TrialOutcome(
        spec=ModeSpec(mode="bf16_pure", optimizer_bits=8),
        status="rejected",
        reasons=("updates lost to rounding: only 6% of the movement " + "x" * 80,),
    )
    with progress:
        progress(event("phase", 0.5, index=-1, label="fp32 reference", steps=120))
        progress(event("start", 10.0))
        progress(event("step", 11.0, step=1, steps=120))  # < 15 s after the start line
        progress(event("step", 26.0, step=60, steps=120))
        progress(event("step", 27.0, step=61, steps=120))
        progress(event("done", 40.0, outcome=outcome))
    lines = out.getvalue().splitlines()
    assert [line.split(" · ")[0] for line in lines[:3]] == [
        "fp32 reference",
        "trial 2/9 bf16_pure+8bit-optim",
        "trial 2/9 bf16_pure+8bit-optim",
    ]
    assert lines[3].startswith("bf16_pure+8bit-optim rejected: updates lost to rounding")
    assert lines[3].endswith("…")
    assert "step 60/120" in lines[2] and len(lines) == 4
    assert all(len(line) <= 80 for line in lines)
    # the quality screen's progress in its report's words (found by a hunt: check printed
    # tune's "rejected" above a table saying "unsafe")
    out = io.StringIO()
    with TuneProgress(Console(file=out, width=80), live=False, screen=True) as screen:
        screen(event("done", 40.0, outcome=outcome))
    assert out.getvalue().startswith("bf16_pure+8bit-optim unsafe: updates lost to rounding")


def test_live_progress_prints_finished_trials_above_the_status_line() -> None:
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    outcome = TrialOutcome(
        spec=ModeSpec(mode="amp_bf16"), status="accepted", samples_per_second=1234.5
    )
    with TuneProgress(console) as progress:
        assert progress.live
        progress(event("start", 1.0, label="amp_bf16"))
        progress(event("done", 2.0, label="amp_bf16", outcome=outcome))
    assert "amp_bf16 accepted 1,234.5 samples/s" in out.getvalue()


def test_tune_reports_phases_steps_and_trials_from_its_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, _ = tiny_gpt.make_small_model()
    events: list[SearchEvent] = []
    tune(
        model,
        tiny_gpt.make_small_batches(),
        budget_minutes=0.3,
        modes=["amp_bf16"],
        on_event=events.append,
        progress=True,
    )
    phases = [e.label for e in events if e.kind == "phase"]
    assert phases[:3] == ["calibration (fp32)", "fp32 reference", "fp32 noise run"]
    first_trial = next(i for i, e in enumerate(events) if e.kind == "start")
    assert all(e.kind in ("phase", "step") for e in events[:first_trial])
    reference_steps = [e for e in events[:first_trial] if e.kind == "step"]
    assert reference_steps and reference_steps[-1].step == reference_steps[-1].steps
    trial = [e for e in events if e.label == "amp_bf16"]
    assert trial[0].kind == "start" and trial[-1].kind == "done"
    assert (trial[0].index, trial[0].total) == (0, 1)
    elapsed = [e.elapsed_seconds for e in events]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0
    assert events[first_trial].elapsed_seconds > 0.5  # counted from tune()'s start
    shown = capsys.readouterr().err  # progress=True without a terminal: plain lines
    assert "fp32 reference · " in shown and "trial 1/1 amp_bf16 · " in shown


def test_counts_and_durations_change_unit_where_their_printed_figure_does() -> None:
    """Found by a hunt: 999,999 read "1000.00k" and 99.6 s read "100 s" (100.2 s read 1:40)."""
    from autoprec.display import format_count
    from autoprec.progress import _seconds

    assert [format_count(n) for n in (999, 1000, 999_994, 999_999)] == [
        "999", "1.00k", "999.99k", "1.00M",
    ]  # fmt: skip
    assert [_seconds(s) for s in (99.4, 99.6, 100.2)] == ["99 s", "1:40", "1:40"]
