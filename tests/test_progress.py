"""Live progress: events from tune() and how the CLI and progress=True show them."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from autoprec.outcomes import TrialOutcome
from autoprec.progress import TuneProgress, status_line
from autoprec.search_events import SearchEvent
from autoprec.specs import ModeSpec
from autoprec.tuning import tune
from examples import tiny_gpt


def event(kind: str, elapsed: float, **fields: object) -> SearchEvent:
    defaults: dict[str, object] = {"index": 1, "total": 9, "label": "bf16_pure+8bit-optim"}
    return SearchEvent(
        kind=kind,  # type: ignore[arg-type]
        elapsed_seconds=elapsed,
        budget_seconds=1800,
        **{**defaults, **fields},  # type: ignore[arg-type]
    )


def test_status_line_has_step_budget_left_and_best() -> None:
    line = status_line(event("step", 754.0, step=40, steps=120, best="amp_bf16"))
    assert line == (
        "trial 2/9 bf16_pure+8bit-optim · step 40/120 · 12:34 of 30:00, 17:26 left · best amp_bf16"
    )
    phase = status_line(event("phase", 3.0, index=-1, label="fp32 reference", steps=120))
    assert phase == "fp32 reference · 120 steps · 3 s of 30:00, 29:57 left"


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
