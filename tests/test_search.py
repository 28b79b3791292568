"""The search, the choice and the candidate list, driven by fake runners (no training)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from autoprec.candidates import candidate_specs
from autoprec.choice import choose, dominates, pareto_front
from autoprec.interrupts import raise_if_interrupted, remembered_interrupts
from autoprec.outcomes import TrialOutcome
from autoprec.probing import probe
from autoprec.search import (
    PRUNE_MARGIN,
    create_study,
    make_stop_check,
    optuna_quiet,
    optuna_storage,
    search,
    shown_storage,
    sqlite_file,
    sqlite_url,
)
from autoprec.search_events import EventSink
from autoprec.specs import ModeSpec
from autoprec.trial_records import StepWindow, TrialProgress
from examples import tiny_gpt
from tests.conftest import make_backends, make_hardware


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def outcome(
    mode: str, status: str = "accepted", speed: float = 100.0, memory: int = 1000, **kwargs: object
) -> TrialOutcome:
    return TrialOutcome(
        spec=ModeSpec(mode=mode),
        status=status,
        samples_per_second=speed,  # type: ignore[arg-type]
        memory_bytes=memory,
        median_step_seconds=1.0 / speed,
        seconds=1.0,
        memory_kind="state_bytes",
        **kwargs,
    )  # type: ignore[arg-type]


SPECS = [ModeSpec(mode=m) for m in ("amp_bf16", "bf16_kahan", "bf16_pure", "amp_fp16")]
RESULTS = {
    "amp_bf16": outcome("amp_bf16", speed=180),
    "bf16_kahan": outcome("bf16_kahan", speed=150, memory=600),
    "bf16_pure": outcome(
        "bf16_pure",
        "rejected",
        speed=170,
        memory=500,
        reasons=("updates lost to rounding: only 23%",),
    ),
    "amp_fp16": outcome("amp_fp16", "failed", reasons=("exception: RuntimeError: boom",)),
}


def fake_runner(clock: FakeClock, log: list[str]):
    def run(spec: ModeSpec, stop) -> TrialOutcome:
        log.append(spec.label)
        clock.now += 10
        return RESULTS[spec.mode]

    return run


def test_every_candidate_in_order_with_states_in_the_study() -> None:
    clock, log = FakeClock(), []
    study = create_study(None, None)
    outcomes = search(
        SPECS,
        fake_runner(clock, log),
        study=study,
        objective="speed",
        deadline=1000,
        expected_trial_seconds=10,
        clock=clock,
    )
    assert log == ["amp_bf16", "bf16_kahan", "bf16_pure", "amp_fp16"]
    assert [o.status for o in outcomes] == ["accepted", "accepted", "rejected", "failed"]
    trials = study.get_trials()
    states = [t.state.name for t in trials]
    assert states == ["COMPLETE", "COMPLETE", "COMPLETE", "FAIL"]
    # rejected by the drift gate: a completed trial with a violated constraint and its reasons
    rejected = trials[2]
    assert rejected.params == {"candidate": "bf16_pure"}
    assert rejected.user_attrs["reasons"] == ["updates lost to rounding: only 23%"]
    assert rejected.system_attrs["constraints:drift"] > 0
    assert trials[0].system_attrs["constraints:drift"] <= 0
    assert trials[0].values == [180.0, 1000.0]


def test_a_run_reuses_only_the_trials_measured_under_its_fingerprint() -> None:
    """Found by a hunt: a run with another model took the empty study over while this one
    measured its references; this run then adopted that run's amp_bf16 and bf16_sr outcomes,
    to the digit, as its own. Trials carry their run's fingerprint digest."""
    from autoprec.search import finished_outcomes

    clock, log = FakeClock(), []
    study = create_study(None, None)
    run = {"study": study, "objective": "speed", "deadline": 1000, "expected_trial_seconds": 10}
    search(SPECS[:2], fake_runner(clock, log), **run, clock=clock, fingerprint="theirs")
    assert [t.user_attrs["fingerprint"] for t in study.get_trials()] == ["theirs", "theirs"]
    assert set(finished_outcomes(study, "theirs")) == {"amp_bf16", "bf16_kahan"}
    assert finished_outcomes(study, "ours") == {}
    search(SPECS[:2], fake_runner(clock, log), **run, clock=clock, fingerprint="ours")
    assert log == ["amp_bf16", "bf16_kahan"] * 2  # measured again, not adopted
    log.clear()
    search(SPECS[:2], fake_runner(clock, log), **run, clock=clock, fingerprint="ours")
    assert log == []  # its own, resumed


def test_budget_stops_launching_trials() -> None:
    clock, log = FakeClock(), []
    outcomes = search(
        SPECS,
        fake_runner(clock, log),
        study=create_study(None, None),
        objective="speed",
        deadline=24,
        expected_trial_seconds=10,
        clock=clock,
    )
    assert log == ["amp_bf16", "bf16_kahan"]  # at t=20, 4 s left < half a trial
    assert outcomes[2].status == "pruned" and outcomes[2].reasons[0].startswith("budget: 4 s left")
    # a run's fixed cost counts too (found by a hunt: a 10 s trial started with 5 s left)
    clock, log = FakeClock(), []
    search(
        SPECS,
        fake_runner(clock, log),
        study=create_study(None, None),
        objective="speed",
        deadline=26,
        expected_trial_seconds=10,
        run_overhead_seconds=2,
        clock=clock,
    )
    assert log == ["amp_bf16", "bf16_kahan"]  # 6 s left < 5 + 2: the third is not started


def windows(times: list[float], warmup: int = 2) -> tuple[StepWindow, ...]:
    """A warm-up window over the first ``warmup`` steps, then one window per step."""
    made = [StepWindow(first_step=0, steps=warmup, seconds=sum(times[:warmup]), samples=warmup,
                       tokens=None, warmup=True)]  # fmt: skip
    made += [
        StepWindow(first_step=i, steps=1, seconds=t, samples=1, tokens=None, warmup=False)
        for i, t in enumerate(times[warmup:], start=warmup)
    ]
    return tuple(made)


def test_the_budget_stop_reserves_the_runs_tail() -> None:
    """Found by a hunt: a 5-7 s eval_fn after a run's last step was not projected, and runs
    ended 11-22% past the budget. The tail calibration measured is reserved."""
    clock = FakeClock()
    clock.now = 93.0  # 7 s left; 5 steps of 1 s to go
    progress = TrialProgress(step=4, steps_planned=10, windows=windows([1.0] * 5), state_bytes=None)
    assert make_stop_check(None, "speed", deadline=100, clock=clock)(progress) is None
    tailed = make_stop_check(None, "speed", deadline=100, clock=clock, tail_seconds=3.0)
    assert tailed(progress) == (
        "budget: 5 more steps of 1 s with the 3 s of held-out pass and eval_fn after them "
        "would pass the deadline"
    )


def test_stop_check() -> None:
    clock = FakeClock()
    best = outcome("amp_bf16", speed=100)  # 10 ms per step
    stop = make_stop_check(best, "speed", deadline=100, clock=clock)

    def progress(times: list[float], steps: int = 50, state: int | None = 900) -> TrialProgress:
        return TrialProgress(
            step=len(times) - 1, steps_planned=steps, windows=windows(times), state_bytes=state
        )

    assert stop(progress([1.0, 1.0, 0.01, 0.01])) is None  # too few measured steps
    assert stop(progress([1.0, 1.0, 0.011, 0.0104, 0.0102])) is None  # within 5%
    assert stop(progress([1.0, 1.0, 0.02, 0.02, 0.02])).startswith("slower than amp_bf16")
    clock.now = 99.8
    assert stop(progress([1.0, 1.0, 0.01, 0.01, 0.01])) == (
        "budget: 45 more steps of 0.01 s would pass the deadline"  # as fast as amp_bf16
    )
    # already past the prune margin when the budget cut it: said, still a budget stop (a
    # resumed study runs it again; one timed step may be a stall)
    clock.now = 0.0
    assert stop(progress([1.0, 1.0, 0.4], steps=600)) == (
        "budget: 597 more steps of 0.4 s would pass the deadline, at 40x amp_bf16's step time"
    )
    clock.now = 99.8
    # one stalled first timed step does not project the run (found by a hunt: a 2.8 s stall
    # of a 10 ms step ended the fp32 reference with "--budget too small", 117 s left); more
    # windows do, and a deadline passed stops it whatever was measured
    clock.now = 0.0
    lone = make_stop_check(None, "speed", deadline=100, clock=clock)
    assert lone(progress([1.0, 1.0, 2.8], steps=60)) is None  # 57 x 2.8 s: 160 of 100 s
    # a mode far too slow for the time left (over twice it) stops after its lone first step
    assert lone(progress([1.0, 1.0, 2.8], steps=200)).startswith("budget: 197 more steps")
    assert lone(progress([1.0, 1.0, 2.8, 0.01, 0.01], steps=60)) is None
    assert lone(progress([1.0, 1.0, 2.8, 2.8, 2.8], steps=80)).startswith("budget: 75 more")
    clock.now = 100.0
    assert lone(progress([1.0, 1.0, 2.8], steps=80)).startswith("budget: the deadline passed")
    # before any timed window, the passes so far (eager runs) bound the step from below
    clock.now = 90.0
    warm = (windows([1.0, 1.0])[0],)
    early = TrialProgress(step=1, steps_planned=50, windows=warm, state_bytes=None)
    assert lone(early) is None  # nothing timed: no pace

    def passes(*seconds: float, step: int = 1) -> TrialProgress:
        return TrialProgress(step, 50, warm if step >= 0 else (), None, pass_seconds=seconds)

    assert lone(passes(0.5, 0.6)) == (
        "budget: 48 more steps of at least 0.5 s (its fastest pass in warm-up) would pass the "
        "deadline"
    )  # 24 s against twice the 10 s left
    assert stop(passes(0.5, 0.6)).endswith(", at 50x amp_bf16's step time")
    assert lone(passes(0.2, 3.0)) is None  # 9.6 s: within twice the 10 s left
    # one pass may be a stall: it stops the run only when it alone took longer than all left
    assert lone(passes(3.0)) is None  # 48 x 3 s, but one more step still fits the 10 s
    assert lone(passes(12.0, step=-1)).startswith("budget: 50 more steps of at least 12 s")
    memory_stop = make_stop_check(best, "memory", deadline=100, clock=FakeClock())
    larger = memory_stop(progress([1.0, 1.0, 1, 1, 1], state=2000))
    assert larger.startswith("larger than") and "2,000 state bytes, more than" in larger
    assert "bytes of state and saved activations" in larger  # what the best's figure holds
    assert memory_stop(progress([1.0, 1.0, 1, 1, 1], state=900)) is None


def test_an_sqlite_file_whose_name_holds_url_characters_is_that_file(tmp_path: Path) -> None:
    """`autoprec tune --out 'q?x.json'` put its study in a file named `q` (the `?` began the
    URL's query) and its references at the `?` name; `%20` was read as a space."""
    from autoprec.fingerprint import references_path

    for name in ("q?x.study.db", "a#b.study.db", "c%20d.study.db", "sub dir/e.study.db"):
        file = tmp_path / name
        url = sqlite_url(file)
        assert sqlite_file(url) == file
        create_study(url, "s").set_user_attr("k", 1)
        assert file.is_file() and sorted(p.name for p in file.parent.iterdir()) == [file.name]
        reference = references_path(url, "s")
        assert reference is not None and reference.parent == file.parent
        file.unlink()
    assert sqlite_file("postgresql://host/db") is None


def test_interrupted_study_resumes_from_sqlite(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    clock, log = FakeClock(), []
    runner = fake_runner(clock, log)

    def interrupted(spec: ModeSpec, stop) -> TrialOutcome:
        if spec.mode == "bf16_pure":
            raise KeyboardInterrupt
        return runner(spec, stop)

    with pytest.raises(KeyboardInterrupt):
        search(
            SPECS,
            interrupted,
            study=create_study(storage, "s"),
            objective="speed",
            deadline=1000,
            expected_trial_seconds=10,
            clock=clock,
        )
    assert log == ["amp_bf16", "bf16_kahan"]
    states = [t.state.name for t in optuna.load_study(study_name="s", storage=storage).trials]
    assert states == ["COMPLETE", "COMPLETE", "FAIL"]  # no RUNNING trial left behind
    events = []
    outcomes = search(
        SPECS,
        runner,
        study=create_study(storage, "s"),
        objective="speed",
        deadline=1000,
        expected_trial_seconds=10,
        clock=clock,
        events=EventSink(events.append, started=0.0, budget_seconds=1000, clock=clock),
    )
    assert log == ["amp_bf16", "bf16_kahan", "bf16_pure", "amp_fp16"]  # nothing run twice
    assert [e.kind for e in events if e.label == "amp_bf16"] == ["skip"]
    assert [o.status for o in outcomes] == ["accepted", "accepted", "rejected", "failed"]


def test_a_ctrl_c_in_the_progress_display_leaves_no_running_trial(tmp_path: Path) -> None:
    # the KeyboardInterrupt arrives in the "start" event (the live display), before the
    # runner: it used to leave the trial RUNNING in the study forever
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    clock = FakeClock()

    def on_event(event: object) -> None:
        if (
            getattr(event, "kind", None) == "start"
            and getattr(event, "label", None) == "bf16_kahan"
        ):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search(
            SPECS,
            fake_runner(clock, []),
            study=create_study(storage, "s"),
            objective="speed",
            deadline=1000,
            expected_trial_seconds=10,
            clock=clock,
            events=EventSink(on_event, started=0.0, budget_seconds=1000, clock=clock),
        )
    trials = optuna.load_study(study_name="s", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL"]
    assert trials[1].user_attrs["reasons"] == ["interrupted"]


def _interrupted_search(storage: str, signal_at_kahan: Callable[[], None]) -> list[str]:
    """Search SPECS in ``storage`` under Python's own SIGINT handler and SIGTERM's default (as
    in a CLI process; a pytest-xdist worker starts with others), calling ``signal_at_kahan``
    in bf16_kahan's trial; returns the candidates run. Raises what the signal raises."""
    clock, log = FakeClock(), []
    runner = fake_runner(clock, log)

    def signalling(spec: ModeSpec, stop) -> TrialOutcome:
        if spec.mode == "bf16_kahan":
            signal_at_kahan()
        return runner(spec, stop)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with remembered_interrupts():
            search(
                SPECS,
                signalling,
                study=create_study(storage, "s"),
                objective="speed",
                deadline=1000,
                expected_trial_seconds=10,
                clock=clock,
            )
    finally:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, term)
    return log


def test_a_sigterm_mid_trial_leaves_no_running_trial(tmp_path: Path) -> None:
    """Found by a hunt: SIGTERM (timeout, Slurm, docker stop) ended the process at once: the
    trial it hit stayed RUNNING in the study for good, and a resume ran it again beside it."""
    from autoprec.interrupts import Terminated

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(Terminated):
        _interrupted_search(storage, lambda: signal.raise_signal(signal.SIGTERM))
    trials = optuna.load_study(study_name="s", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL"]


class _SwallowsCtrlC:
    """Presses Ctrl-C from its ``__del__``: Python prints "Exception ignored" and goes on, as it
    did when a real Ctrl-C landed in SQLAlchemy's weakref callback during a collection (CI)."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_swallowed_by_the_garbage_collector_stops_at_the_next_trial(
    tmp_path: Path,
) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    # dropped at once: its __del__ runs in the trial, and the interrupt is lost
    with pytest.raises(KeyboardInterrupt):
        _interrupted_search(storage, _SwallowsCtrlC)
    trials = optuna.load_study(study_name="s", storage=storage).trials
    # the lost press stopped the run after its trial, whose result is kept
    assert [(t.params["candidate"], t.state.name) for t in trials] == [
        ("amp_bf16", "COMPLETE"),
        ("bf16_kahan", "COMPLETE"),
    ]
    raise_if_interrupted()  # and forgotten: nothing pending after the block


def test_pareto_and_choice() -> None:
    reference = outcome("fp32", speed=100, memory=1000)
    outcomes = list(RESULTS.values())
    front = pareto_front([reference, *outcomes])
    assert [o.label for o in front] == ["amp_bf16", "bf16_kahan"]  # fp32 dominated by amp_bf16
    assert dominates(RESULTS["amp_bf16"], reference)
    assert choose(outcomes, reference, "speed").label == "amp_bf16"
    assert choose(outcomes, reference, "memory").label == "bf16_kahan"  # bf16_pure rejected
    assert choose(outcomes, reference, "balanced").label == "bf16_kahan"  # 1.5 x 1.67 > 1.8
    nothing = [outcome("amp_bf16", "rejected"), outcome("bf16_sr", "pruned")]
    assert choose(nothing, reference, "speed") is reference


def test_candidates_on_cpu() -> None:
    report = probe(
        *tiny_gpt.make_small_model(), hardware=make_hardware(), backends=make_backends("all")
    )
    candidates = candidate_specs(report)
    labels = [spec.label for spec in candidates.specs]
    assert labels[0] == "fp32" and labels[1] == "amp_bf16"
    assert labels[-1] == "amp_fp16"  # possible on a CPU, but not worth much: last
    assert "fp32+8bit-optim" in labels
    assert {s.spec.mode for s in candidates.skipped} == {"tf32", "fp8_te", "fp8_torchao"}
    kahan = next(spec for spec in candidates.specs if spec.mode == "bf16_kahan")
    assert "ln_f" in kahan.keep_fp32 and "wte" in kahan.keep_fp32  # norms, embeddings
    assert next(s for s in candidates.specs if s.mode == "amp_bf16").keep_fp32 == ()


def test_candidates_on_a_cpu_without_bf16_instructions_try_what_can_win_first() -> None:
    """make demo on such a CPU: every bf16 trial (amp_bf16 13.7x fp32's step) ran until the
    budget cut it, and fp32 with 8-bit states never ran. Now the bf16 modes come after it,
    by default without their 8-bit variants; a named 8-bit variant runs after its mode."""
    from tests.conftest import CPU

    slow_bf16 = make_hardware(cpu=CPU.model_copy(update={"native_bf16": False}))
    report = probe(*tiny_gpt.make_small_model(), hardware=slow_bf16, backends=make_backends("all"))
    labels = [spec.label for spec in candidate_specs(report).specs]
    assert labels[:2] == ["fp32", "fp32+8bit-optim"]
    assert set(labels[2:]) == {
        "amp_bf16",
        "bf16_kahan",
        "bf16_sr_kahan",
        "bf16_sr",
        "bf16_pure",
    } | {"amp_fp16"}
    named = candidate_specs(report, ["bf16_pure", "bf16_pure+8bit-optim", "fp32+8bit-optim"])
    assert [s.label for s in named.specs] == [
        "fp32",
        "fp32+8bit-optim",
        "bf16_pure",
        "bf16_pure+8bit-optim",
    ]


def test_candidates_on_h100() -> None:
    report = probe(
        *tiny_gpt.make_model(), hardware=make_hardware("H100"), backends=make_backends("all")
    )
    labels = [spec.label for spec in candidate_specs(report).specs]
    # FP8 on this small model is possible but not worth a trial: after the promising modes
    assert labels[:3] == ["fp32", "amp_bf16", "bf16_kahan"]
    assert {
        "fp8_torchao+tensorwise",
        "fp8_torchao+rowwise",
        "fp8_te+delayed_hybrid",
        "fp8_te+current",
        "tf32",
    } <= set(labels)


def test_candidates_restricted_and_unknown() -> None:
    report = probe(hardware=make_hardware(), backends=make_backends("all"))
    restricted = candidate_specs(report, ["bf16_kahan", "tf32"])
    assert [s.label for s in restricted.specs][:2] == ["fp32", "bf16_kahan"]
    assert [s.spec.mode for s in restricted.skipped] == ["tf32"]
    with pytest.raises(ValueError, match=r"Unknown mode\(s\) \['fp64'\]") as raised:
        candidate_specs(report, ["fp64"])
    assert "label" not in str(raised.value)
    # a label copied from a report names its mode (found by a hunt)
    with pytest.raises(ValueError, match=r"pass 'fp8_torchao'; tune\(\) and check\(\) try"):
        candidate_specs(report, ["fp8_torchao+tensorwise+emulated"])
    with pytest.raises(ValueError, match=r"pass 'bf16_sr\+8bit-optim', and compile=True"):
        candidate_specs(report, ["bf16_sr+8bit-optim+compiled"])  # the states kept: a review


def test_unopenable_storage_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(ValueError, match=r"Cannot open the study storage .*folder exists"):
        create_study(f"sqlite:///{tmp_path / 'a_file' / 'study.db'}", "s")


def test_a_locked_storage_says_another_process_holds_it(tmp_path: Path) -> None:
    """Found by a hunt: a database another process held locked was met with "check the path
    and that its folder exists and is writable"."""
    import sqlite3

    path = tmp_path / "study.db"
    create_study(f"sqlite:///{path}", "s")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(ValueError, match=r"database is locked.*another process holds"):
            create_study(f"sqlite:///{path}", "s")
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_the_folder_of_an_sqlite_study_is_created(tmp_path: Path) -> None:
    create_study(f"sqlite:///{tmp_path / 'missing' / 'dir' / 'study.db'}", "s")
    assert (tmp_path / "missing" / "dir" / "study.db").is_file()


def test_a_trial_left_waiting_does_not_hijack_the_next_candidate(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = create_study(storage, "s")
    study.enqueue_trial({"candidate": "bf16_pure"})  # an interrupted run left this waiting
    clock, log = FakeClock(), []
    outcomes = search(
        SPECS[:2],
        fake_runner(clock, log),
        study=create_study(storage, "s"),
        objective="speed",
        deadline=1000,
        expected_trial_seconds=10,
        clock=clock,
        choices=[s.label for s in SPECS],
    )
    assert [o.label for o in outcomes] == ["amp_bf16", "bf16_kahan"]
    trials = optuna.load_study(study_name="s", storage=storage).get_trials()
    recorded = {t.params["candidate"]: t.state.name for t in trials}
    assert recorded == {"bf16_pure": "FAIL", "amp_bf16": "COMPLETE", "bf16_kahan": "COMPLETE"}


def test_pruning_compares_the_same_steps() -> None:
    """The best run's first batches were its long ones (its median, over all its steps, is
    short): a candidate 10% faster on every single step was pruned by its running median."""
    best_steps = [1.0, 1.0] + [0.2] * 5 + [0.1] * 45
    best = outcome("amp_bf16", speed=100, windows=windows(best_steps))
    best = best.model_copy(update={"median_step_seconds": 0.1})
    faster = windows([0.9 * seconds for seconds in best_steps[:7]])
    progress = TrialProgress(step=6, steps_planned=50, windows=faster, state_bytes=None)
    assert make_stop_check(best, "speed", deadline=1e9, clock=FakeClock())(progress) is None
    unpaired = best.model_copy(update={"windows": ()})  # the old comparison
    stop = make_stop_check(unpaired, "speed", deadline=1e9, clock=FakeClock())
    assert stop(progress).startswith("slower than amp_bf16: 180 vs 100 ms/step")
    slower = windows([1.2 * seconds for seconds in best_steps[:7]])
    check = make_stop_check(best, "speed", deadline=1e9, clock=FakeClock())
    reason = check(dataclasses.replace(progress, windows=slower))
    assert reason == "slower than amp_bf16: 1.20x its step time on the same 5 steps"


def test_pruning_leaves_modes_within_the_races_noise() -> None:
    """Two trials of one mode raced on our CPU differed by up to 1.09x (bf16_sr): a candidate
    10% slower in its first windows stays in the race (the choice re-times it side by side if
    it is accepted); one 1.25x slower is pruned."""
    best_steps = [1.0, 1.0] + [0.1] * 48
    best = outcome("amp_bf16", speed=100, windows=windows(best_steps))
    check = make_stop_check(best, "speed", deadline=1e9, clock=FakeClock())

    def raced(factor: float) -> str | None:
        times = [1.0, 1.0] + [0.1 * factor] * 5
        return check(
            TrialProgress(step=6, steps_planned=50, windows=windows(times), state_bytes=None)
        )

    assert raced(1.10) is None
    assert raced(1 + PRUNE_MARGIN - 0.01) is None  # just inside the race's margin
    assert raced(1.25) == "slower than amp_bf16: 1.25x its step time on the same 5 steps"


def test_a_pruned_ratio_reads_above_its_cut_off() -> None:
    """Pruned beyond 1/0.85 = 1.1765x: a trial at 1.177x read "1.18x", the cut-off itself."""
    best = outcome("amp_bf16", speed=100, windows=windows([1.0, 1.0] + [0.1] * 48))
    check = make_stop_check(best, "speed", deadline=1e9, clock=FakeClock())
    times = [1.0, 1.0] + [0.1 * 1.177] * 5
    reason = check(
        TrialProgress(step=6, steps_planned=50, windows=windows(times), state_bytes=None)
    )
    assert reason == "slower than amp_bf16: 1.177x its step time on the same 5 steps"


def test_within_the_measured_noise_the_mode_closest_to_fp32_wins() -> None:
    reference = outcome("fp32", speed=100)
    outcomes = [outcome("bf16_pure", speed=103), outcome("amp_bf16", speed=101)]
    assert choose(outcomes, reference, "speed").label == "bf16_pure"  # no noise: fastest
    assert choose(outcomes, reference, "speed", speed_margin=0.025).label == "amp_bf16"
    assert choose(outcomes, reference, "speed", speed_margin=0.05).label == "fp32"


def test_recompiles_after_warmup_are_shown_with_the_verdict() -> None:
    recompiled = outcome("amp_bf16", speed=100).model_copy(update={"recompiles": 3})
    assert recompiled.notes[0].startswith("recompiled 3x after warm-up")
    assert outcome("amp_bf16", speed=100).notes == ()


def test_a_storage_path_is_a_journal_file_unless_it_holds_sqlite(tmp_path: Path) -> None:
    assert optuna_storage(None) is None
    assert optuna_storage("postgresql://host/db") == "postgresql://host/db"
    journal = optuna_storage(str(tmp_path / "new" / "study.log"))
    assert isinstance(journal, optuna.storages.JournalStorage)
    assert (tmp_path / "new").is_dir()
    database = tmp_path / "study.db"
    create_study(f"sqlite:///{database}", "s")
    assert optuna_storage(str(database)) == f"sqlite:///{database}"


def test_a_file_that_is_no_study_storage_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """An existing text file given as the storage was opened as a journal: Optuna appended its
    first record to the user's file, then failed with advice about folders."""
    notes = tmp_path / "notes.txt"
    notes.write_text("lr=3e-4 baseline 2.31\n")
    with pytest.raises(ValueError, match="neither an SQLite database nor an Optuna journal") as no:
        create_study(str(notes), "s")
    assert "Cannot open" not in str(no.value) and "nothing was written" in str(no.value)
    assert notes.read_text() == "lr=3e-4 baseline 2.31\n"
    empty, journal = tmp_path / "empty.log", tmp_path / "study.log"
    empty.write_text("")
    create_study(str(empty), "s")  # an empty file becomes a journal
    create_study(str(journal), "s")
    assert create_study(str(journal), "s").study_name == "s"  # a journal reopens
    damaged = tmp_path / "damaged.db"
    create_study(f"sqlite:///{damaged}", "s")
    damaged.write_bytes(damaged.read_bytes()[:2048])  # the header and a little more
    with pytest.raises(ValueError, match=r"not a usable SQLite database .* move it aside"):
        create_study(f"sqlite:///{damaged}", "s")
    # found by a hunt: a journal cut inside its last record was opened, the next record was
    # appended onto the partial line, and the file was unreadable for good
    cut = tmp_path / "cut.log"
    create_study(str(cut), "s").set_user_attr("k", 1)
    cut.write_bytes(cut.read_bytes()[:-37])
    before = cut.read_bytes()
    with pytest.raises(ValueError, match=r"ends in a partial record .* Nothing was written"):
        create_study(str(cut), "s")
    assert cut.read_bytes() == before


def test_a_study_of_yours_is_refused_in_one_message(tmp_path: Path) -> None:
    """The refusal of a study that is not autoprec's was wrapped in "Cannot open the study
    storage (...); check the path and that its folder exists and is writable"."""
    storage = f"sqlite:///{tmp_path / 'mine.db'}"
    optuna.create_study(storage=storage, study_name="mine", direction="minimize")
    with pytest.raises(ValueError, match=r"'mine' in .* is not an autoprec study") as refused:
        create_study(storage, "mine")
    assert "Cannot open" not in str(refused.value) and "writable" not in str(refused.value)


def test_optunas_log_level_is_the_callers_again_after_a_search() -> None:
    optuna.logging.set_verbosity(optuna.logging.INFO)
    with optuna_quiet():
        assert optuna.logging.get_verbosity() == optuna.logging.WARNING
    assert optuna.logging.get_verbosity() == optuna.logging.INFO


def test_opening_a_fresh_database_another_process_is_creating_is_tried_again() -> None:
    # two `autoprec tune` on one new SQLite file: one failed with "table studies already
    # exists" (3 runs in 5), reported as a bad URL
    from autoprec.search import _retried

    calls: list[int] = []

    def racing() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("(sqlite3.OperationalError) table studies already exists")
        return "study"

    assert _retried(racing) == "study" and len(calls) == 3

    def broken() -> str:
        calls.append(1)
        raise RuntimeError("no such driver")

    calls.clear()
    with pytest.raises(RuntimeError, match="no such driver"):
        _retried(broken)
    assert len(calls) == 1


def test_study_result_fits_a_mysql_text_column_and_reads_back(tmp_path: Path) -> None:
    """An 18-mode tune of 300-step trials on a 32-layer model: the study's ``result``
    attribute stays under MySQL's 65,535-byte TEXT column (Optuna keeps attributes there), and
    a report drawn from the study reads every outcome back with its figures."""
    import json

    from autoprec.report import outcomes_from_study
    from autoprec.search import record_result

    norms = tuple(f"model.layers.{i}.{n}" for i in range(32) for n in ("input_layernorm", "post"))
    windows = tuple(
        StepWindow(
            first_step=10 * i, steps=10, seconds=0.12345, samples=80, tokens=5120, warmup=i < 1
        )
        for i in range(30)
    )
    outcomes = [
        outcome(
            "amp_bf16" if i else "fp32",
            speed=100.0 + i,
            windows=windows,
            reasons=("held-out loss +0.0123 worse than fp32, beyond 0.0045 (3 x noise floor)",) * 3,
        ).model_copy(update={"spec": ModeSpec(mode="amp_bf16", keep_fp32=norms)})
        for i in range(18)
    ]
    storage = sqlite_url(tmp_path / "s.db")
    study = optuna.create_study(storage=storage, study_name="autoprec", directions=["maximize"])
    with_windows = len(json.dumps([o.model_dump(mode="json") for o in outcomes]))
    record_result(study, "amp_bf16", outcomes)
    stored = len(json.dumps(optuna.load_study(study_name="autoprec", storage=storage).user_attrs))
    assert with_windows > 65_535 > stored  # the windows took it past
    read, chosen, _ = outcomes_from_study(storage, "autoprec")
    assert chosen == "amp_bf16" and len(read) == 18
    assert [o.samples_per_second for o in read] == [o.samples_per_second for o in outcomes]
    assert read[0].spec.keep_fp32 == norms and read[0].windows == ()


def test_a_storage_password_is_hidden_whatever_characters_it_holds() -> None:
    # a password holding '/' was printed whole (the pattern stopped at the first '/')
    for password in ("s3cret", "a/b", "a:b/c", "p%40ss"):
        shown = shown_storage(f"postgresql+psycopg2://user:{password}@db.example:5432/studies")
        assert shown == "postgresql+psycopg2://user:***@db.example:5432/studies"
    assert shown_storage("postgresql://user@host/db") == "postgresql://user@host/db"
    assert shown_storage("sqlite:///runs/a:b@c.db") == "sqlite:///runs/a:b@c.db"
    assert shown_storage(None) == "memory"
    # found by a hunt: a user name holding '@' (Azure's user@server), and a query password
    assert (
        shown_storage("postgresql://u@corp:Hunter2pw@db:5432/o")
        == "postgresql://u@corp:***@db:5432/o"
    )
    assert shown_storage("postgresql://u@db/o?sslmode=require&password=Hunter2pw&x=1") == (
        "postgresql://u@db/o?sslmode=require&password=***&x=1"
    )


def test_a_background_job_still_takes_sigterm() -> None:
    """Found by a hunt: a shell starts `cmd &` with SIGINT ignored, and SIGTERM was then left
    to its default (the process ended at once, its trial RUNNING)."""
    from autoprec.interrupts import _remember_and_raise

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with remembered_interrupts():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the job's choice kept
            assert signal.getsignal(signal.SIGTERM) is _remember_and_raise
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        with remembered_interrupts(terminate=False):  # tune() from Python: Ctrl-C alone
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, term)


def test_a_sigterm_held_behind_an_ignored_ctrl_c_still_arrives() -> None:
    """A review: only the first held signal was delivered, so a SIGTERM held after a Ctrl-C
    that a background job ignores was dropped and the run went on."""
    from autoprec.interrupts import Terminated, interrupts_deferred

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    with remembered_interrupts():  # SIGTERM taken, Ctrl-C left ignored
        try:
            with pytest.raises(Terminated), interrupts_deferred():
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGTERM)
        finally:
            signal.signal(signal.SIGINT, previous)
    raise_if_interrupted()  # the block forgot it


def test_a_ctrl_c_during_a_trials_record_arrives_after_it() -> None:
    """Found by a hunt: a second Ctrl-C inside the cleanup of the first left the trial
    RUNNING; the record is written whole, then the press is raised."""
    from autoprec.interrupts import interrupts_deferred

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    written: list[str] = []
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # as torch's and the display's threads run:
    other.start()  # a masked main thread got the signal anyway (a review)
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)  # to whichever thread the kernel picks
            time.sleep(0.05)
            written.append("record")
    finally:
        stop.set()
        other.join()
        signal.signal(signal.SIGINT, previous)
    assert written == ["record"]
