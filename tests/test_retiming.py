"""confirm_speed: which modes are re-timed, in what order, and what replaces their figures."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from autoprec.outcomes import Objective, TrialOutcome
from autoprec.retiming import CONFIRM_WITHIN, confirm_speed
from autoprec.specs import ModeSpec


def _outcome(mode: str, samples: float, status: str = "accepted") -> TrialOutcome:
    return TrialOutcome(
        spec=ModeSpec(mode=mode),
        status=status,
        samples_per_second=samples,
        tokens_per_second=samples * 10,
        median_step_seconds=1.0 / samples,
    )


class FakeTimer:
    """Times a spec at the next speed of its queue and logs the order it was asked in."""

    def __init__(self, speeds: dict[str, list[float]]) -> None:
        self.speeds = speeds
        self.asked: list[str] = []

    def __call__(self, spec: ModeSpec) -> SimpleNamespace:
        self.asked.append(spec.mode)
        return SimpleNamespace(completed=True, samples_per_second=self.speeds[spec.mode].pop(0))


def test_contenders_are_retimed_both_ways_and_their_means_replace_the_figures() -> None:
    reference = _outcome("fp32", 100.0)
    bf16 = _outcome("amp_bf16", 200.0)
    fp16 = _outcome("amp_fp16", 200.0 * (1 - CONFIRM_WITHIN) + 1)  # within 30%: a contender
    pure = _outcome("bf16_pure", 300.0, status="rejected")  # not accepted: never re-timed
    timer = FakeTimer(
        {"amp_bf16": [180.0, 190.0], "amp_fp16": [200.0, 210.0], "fp32": [95.0, 95.0]}
    )

    outcomes, new_reference, noise = confirm_speed(
        [bf16, fp16, pure], reference, deadline=1e9, clock=lambda: 0.0, time_spec=timer
    )

    # ABC then CBA; fp32, at half the speed no contender, is re-timed with them: the evidence
    # sets the chosen speed beside the reference's (a re-timed one beside a trial one mixed
    # two measures)
    assert timer.asked == ["amp_bf16", "amp_fp16", "fp32", "fp32", "amp_fp16", "amp_bf16"]
    assert new_reference.retimed and new_reference.samples_per_second == 95.0
    by_mode = {o.spec.mode: o for o in outcomes}
    assert by_mode["amp_bf16"].samples_per_second == pytest.approx(185.0)
    assert by_mode["amp_fp16"].samples_per_second == pytest.approx(205.0)
    # tokens/s and step time scale with the new speed
    assert by_mode["amp_bf16"].tokens_per_second == pytest.approx(1850.0)
    assert by_mode["amp_bf16"].median_step_seconds == pytest.approx(1 / 185.0)
    assert by_mode["bf16_pure"] == pure
    assert noise == pytest.approx(max(10 / 185, 10 / 205))


def test_an_accepted_mode_whose_one_trial_ran_slow_is_retimed() -> None:
    """The first H200 run's figures: amp_bf16's trial timed 15.4% below tf32's, outside the 15%
    band re-timed before, and tf32 was chosen; amp_bf16 timed 1971 samples/s on its own."""
    reference = _outcome("fp32", 480.0)  # 29% of the fastest: no contender
    tf32, bf16 = _outcome("tf32", 1649.0), _outcome("amp_bf16", 1396.0)
    timer = FakeTimer(
        {"tf32": [1620.0, 1630.0], "amp_bf16": [1950.0, 1970.0], "fp32": [470.0, 470.0]}
    )

    outcomes, new_reference, _ = confirm_speed(
        [bf16, tf32], reference, deadline=1e9, clock=lambda: 0.0, time_spec=timer
    )

    assert timer.asked == ["tf32", "amp_bf16", "fp32", "fp32", "amp_bf16", "tf32"]
    assert new_reference.samples_per_second == 470.0
    by_mode = {o.spec.mode: o for o in outcomes}
    assert by_mode["amp_bf16"].retimed and by_mode["amp_bf16"].samples_per_second == 1960.0
    assert by_mode["tf32"].samples_per_second == 1625.0


def test_nothing_is_retimed_without_two_contenders_or_time_for_them() -> None:
    reference = _outcome("fp32", 100.0)
    fast = _outcome("amp_bf16", 200.0)
    timer = FakeTimer({})
    alone = confirm_speed([fast], reference, deadline=1e9, clock=lambda: 0.0, time_spec=timer)
    assert alone == ([fast], reference, None)  # fp32 is more than 30% slower: no contest

    close = _outcome("amp_fp16", 195.0)
    late = confirm_speed([fast, close], reference, deadline=0.5, clock=lambda: 0.0, time_spec=timer)
    assert late == ([fast, close], reference, None)  # 2.5 x 30 steps of each (0.76 s) do not fit
    assert timer.asked == []


def test_a_retiming_cut_short_keeps_the_trial_figures() -> None:
    reference = _outcome("fp32", 100.0)
    fast, close = _outcome("amp_bf16", 200.0), _outcome("amp_fp16", 195.0)

    def cut_short(spec: ModeSpec) -> SimpleNamespace:
        return SimpleNamespace(completed=spec.mode != "amp_fp16", samples_per_second=190.0)

    result = confirm_speed(
        [fast, close], reference, deadline=1e9, clock=lambda: 0.0, time_spec=cut_short
    )
    assert result == ([fast, close], reference, None)


def test_a_second_round_decides_what_the_first_left_within_its_noise() -> None:
    """One slow re-timing (amp_bf16 594 against 758; seen in make demo on our CPU machines)
    made the noise 24%, and fp32 within it of amp_bf16: a second round runs, the four
    re-timings give the speeds, and the noise is that of a round's mean."""
    reference, bf16 = _outcome("fp32", 600.0), _outcome("amp_bf16", 700.0)
    timer = FakeTimer(
        {"amp_bf16": [594.0, 758.0, 750.0, 760.0], "fp32": [565.0, 631.0, 600.0, 610.0]}
    )

    outcomes, new_reference, noise = confirm_speed(
        [bf16], reference, deadline=1e9, clock=lambda: 0.0, time_spec=timer
    )

    assert timer.asked == ["amp_bf16", "fp32", "fp32", "amp_bf16"] * 2
    assert outcomes[0].samples_per_second == pytest.approx((594 + 758 + 750 + 760) / 4)
    assert new_reference.samples_per_second == pytest.approx((565 + 631 + 600 + 610) / 4)
    assert noise == pytest.approx((755 - 676) / ((755 + 676) / 2))  # amp_bf16's round means
    assert new_reference.samples_per_second < outcomes[0].samples_per_second * (1 - noise)


def test_no_second_round_without_the_time_for_it_or_when_it_is_cut_short() -> None:
    reference, bf16 = _outcome("fp32", 600.0), _outcome("amp_bf16", 700.0)
    now = [0.0]

    def spent_after_first_round(spec: ModeSpec) -> SimpleNamespace:
        now[0] += 0.1  # 4 re-timings: 0.4 s of the 0.5 s left; a round needs 2.5 x 30 steps
        return SimpleNamespace(
            completed=True, samples_per_second={"amp_bf16": 600.0}.get(spec.mode, 560.0)
        )

    outcomes, _, noise = confirm_speed(
        [bf16], reference, deadline=0.5, clock=lambda: now[0], time_spec=spent_after_first_round
    )
    assert now[0] == pytest.approx(0.4) and noise == 0.0  # one round, 600 vs 560: undecided
    assert outcomes[0].samples_per_second == pytest.approx(600.0)

    speeds = {"amp_bf16": [640.0, 600.0, 700.0, 700.0], "fp32": [600.0, 600.0, 500.0, 500.0]}
    calls: list[str] = []

    def cut_in_second_round(spec: ModeSpec) -> SimpleNamespace:
        calls.append(spec.mode)
        speed = speeds[spec.mode].pop(0)
        return SimpleNamespace(completed=len(calls) <= 5, samples_per_second=speed)

    outcomes, new_reference, noise = confirm_speed(
        [bf16], reference, deadline=1e9, clock=lambda: 0.0, time_spec=cut_in_second_round
    )
    assert len(calls) == 6  # the second round ran, and its second re-timing did not complete
    assert noise == pytest.approx(40 / 620)  # the first round's figures and noise stand
    assert (outcomes[0].samples_per_second, new_reference.samples_per_second) == (620.0, 600.0)


def test_every_contender_is_retimed_and_only_retimed_figures_compete() -> None:
    # with three contenders re-timed (all 7% below their trials, as on our CPU) the fourth kept
    # its trial figure and won: the slowest mode in the trials, and the farthest from fp32
    from autoprec.choice import choose

    reference = _outcome("fp32", 50.0)
    trials = [
        _outcome("amp_bf16", 100.0),
        _outcome("bf16_kahan", 99.0),
        _outcome("amp_fp16", 98.0),
        _outcome("bf16_pure", 97.0),
    ]
    timer = FakeTimer(
        {o.spec.mode: [o.samples_per_second * 0.93] * 4 for o in [*trials, reference]}
    )
    outcomes, reference, noise = confirm_speed(trials, reference, 1e9, lambda: 0.0, timer)
    assert sorted(set(timer.asked)) == sorted(o.spec.mode for o in [*trials, reference])
    assert all(o.retimed for o in outcomes) and reference.retimed
    assert choose(outcomes, reference, "speed", noise or 0.0).spec.mode == "amp_bf16"


def test_the_budget_trims_contenders_from_the_slowest_and_the_choice_keeps_to_the_retimed() -> None:
    from autoprec.choice import choose

    reference = _outcome("fp32", 50.0)
    # within re-timing's 30% of the fastest, beyond the 9.2% in which one may tie it (a
    # contender within that is re-timed with the others or none is: the test above)
    trials = [_outcome("amp_bf16", 100.0), _outcome("amp_fp16", 85.0), _outcome("bf16_pure", 80.0)]
    timer = FakeTimer({o.spec.mode: [o.samples_per_second * 0.9] * 4 for o in [*trials, reference]})
    # time for the fastest's and the reference's re-timings (2.5 x 30 steps each), no more:
    # the reference is kept, the slowest contenders go
    budget = 2.5 * 30 * (1 / 100.0 + 1 / 50.0) + 0.1
    outcomes, reference, noise = confirm_speed(trials, reference, budget, lambda: 0.0, timer)
    assert sorted(set(timer.asked)) == ["amp_bf16", "fp32"]
    by_mode = {o.spec.mode: o for o in outcomes}
    assert not by_mode["bf16_pure"].retimed and by_mode["bf16_pure"].samples_per_second == 80.0
    assert not by_mode["amp_fp16"].retimed and reference.retimed
    assert choose(outcomes, reference, "speed", noise or 0.0).spec.mode == "amp_bf16"


def _lean(mode: str, samples: float, memory: int) -> TrialOutcome:
    return _outcome(mode, samples).model_copy(update={"memory_bytes": memory})


def test_balanced_retimes_its_leaders_with_the_reference_and_compares_like_with_like() -> None:
    """Found by a hunt: balanced divided a re-timed mode's speed by the re-timed reference's
    and an unre-timed one's by the same, so a mode outside the speed band gained what the
    re-timing took from the reference: with every re-timing 10% below its trial, amp_bf16
    (1.22 by trial figures) lost to bf16_pure (1.17 by trial figures, 1.30 mixed)."""
    from autoprec.choice import choose

    reference = _lean("fp32", 100.0, 1000)
    amp = _lean("amp_bf16", 110.0, 900)  # speed-up 1.10 x saving 1.11 = 1.22
    pure = _lean("bf16_pure", 70.0, 600)  # 0.70 x 1.67 = 1.17, within 30% of the best score
    timer = FakeTimer(
        {o.spec.mode: [o.samples_per_second * 0.9] * 4 for o in (reference, amp, pure)}
    )
    outcomes, new_reference, noise = confirm_speed(
        [amp, pure], reference, 1e9, lambda: 0.0, timer, objective="balanced"
    )
    assert sorted(set(timer.asked)) == ["amp_bf16", "bf16_pure", "fp32"]  # the reference too
    assert new_reference.retimed and all(o.retimed for o in outcomes)
    assert choose(outcomes, new_reference, "balanced", noise or 0.0).spec.mode == "amp_bf16"
    # a mode outside the balanced band is left at its trial figure and out of the choice
    slow = _lean("amp_fp16", 20.0, 990)  # 0.2 x 1.01: far below
    timer = FakeTimer(
        {o.spec.mode: [o.samples_per_second * 0.9] * 4 for o in (reference, amp, pure)}
    )
    outcomes, new_reference, noise = confirm_speed(
        [amp, pure, slow], reference, 1e9, lambda: 0.0, timer, objective="balanced"
    )
    assert "amp_fp16" not in timer.asked
    assert choose(outcomes, new_reference, "balanced", noise or 0.0).spec.mode == "amp_bf16"
    # speed re-times by speed alone, as before (fp32 at 100 is within 30% of 110)
    timer = FakeTimer({o.spec.mode: [o.samples_per_second * 0.9] * 4 for o in (reference, amp)})
    confirm_speed([amp, pure], reference, 1e9, lambda: 0.0, timer)
    assert sorted(set(timer.asked)) == ["amp_bf16", "fp32"]


def test_a_balanced_run_times_a_second_round_only_when_its_scores_are_close() -> None:
    """The second round asked whether two speeds were within noise, under balanced too, whose
    choice compares speed-up times memory saving: modes equally fast whose scores lie far
    apart took a second round (budget spent) that could not change the choice."""
    reference = _lean("fp32", 100.0, 1000)
    lean = _lean("bf16_kahan", 100.0, 500)  # score 2.0

    def rounds(amp_memory: int, objective: Objective) -> int:
        amp = _lean("amp_bf16", 100.0, amp_memory)
        timer = FakeTimer({mode: [100.0, 90.0] * 4 for mode in ("fp32", "amp_bf16", "bf16_kahan")})
        confirm_speed([amp, lean], reference, 1e9, lambda: 0.0, timer, objective=objective)
        return len(timer.asked) // 6  # 3 contenders, 2 orders; every mode's noise 10.5%

    assert rounds(650, "balanced") == 1  # 1.54 against 2.0: decided
    assert rounds(520, "balanced") == 2  # 1.92 against 2.0: within the noise
    assert rounds(650, "speed") == 2  # the same speeds: a tie, as before


def test_one_slow_retiming_of_a_slow_mode_does_not_tie_the_fastest_with_fp32() -> None:
    """Found by a hunt: the tie band was the largest noise of any re-timed mode. bf16_kahan's
    one-off slow re-timing (95, then 60: 45% noise) put fp32 within "noise" of amp_bf16, 30%
    faster on every re-timing, and fp32 was chosen. Each pair is now judged on its own two
    modes' noise."""
    from autoprec.choice import choose

    reference = _outcome("fp32", 100.0)
    trials = [_outcome("amp_bf16", 130.0), _outcome("bf16_kahan", 95.0)]
    # bf16_kahan within its own noise of amp_bf16 after one round: a second round runs
    timer = FakeTimer(
        {"fp32": [100.0] * 4, "amp_bf16": [130.0] * 4, "bf16_kahan": [95.0, 60.0, 95.0, 60.0]}
    )
    outcomes, new_reference, noise = confirm_speed(
        trials, reference, 1e9, lambda: 0.0, timer, objective="balanced"
    )  # balanced re-times the reference with them; the choice below is the speed one
    assert len(timer.asked) == 12 and noise == 0.0  # round means 77.5 and 77.5
    first_round_only = FakeTimer(
        {"fp32": [100.0] * 2, "amp_bf16": [130.0] * 2, "bf16_kahan": [95.0, 60.0]}
    )
    outcomes, new_reference, noise = confirm_speed(
        trials, reference, 1e9, lambda: 0.0, _one_round(first_round_only), objective="balanced"
    )
    assert noise == pytest.approx(35 / 77.5)  # the largest, reported as before
    by_mode = {o.spec.mode: o for o in outcomes}
    assert by_mode["bf16_kahan"].timing_noise == pytest.approx(35 / 77.5)
    assert by_mode["amp_bf16"].timing_noise == 0.0 and new_reference.timing_noise == 0.0
    assert choose(outcomes, new_reference, "speed").spec.mode == "amp_bf16"
    # a mode whose own noise covers the gap still ties, and the one closer to fp32 wins
    noisy = by_mode["amp_bf16"].model_copy(update={"timing_noise": 0.3})
    assert choose([noisy, by_mode["bf16_kahan"]], new_reference, "speed").spec.mode == "fp32"


def _one_round(timer: FakeTimer) -> Any:
    """``timer`` for one round; a second round's first re-timing does not complete."""

    def timed(spec: ModeSpec) -> SimpleNamespace:
        if not timer.speeds[spec.mode]:
            return SimpleNamespace(completed=False, samples_per_second=None)
        return timer(spec)

    return timed


def test_the_table_marks_the_speeds_that_come_from_re_timings() -> None:
    """Only re-timed modes compete on speed once any was re-timed, and a re-timing and a trial
    are different measures: the table said nothing of which figure was which."""
    import io
    import types

    from rich.console import Console

    from autoprec.display import RETIMED_MARK, tune_table
    from autoprec.tune_result import BudgetReport, TuneResult

    def outcome(mode: str, speed: float, retimed: bool) -> TrialOutcome:
        return TrialOutcome(
            spec=ModeSpec(mode=mode),
            status="accepted",
            samples_per_second=speed,
            memory_bytes=2**20,
            retimed=retimed,
        )

    budget = BudgetReport(
        budget_seconds=60, used_seconds=50, calibration_seconds=1, reference_seconds=5,
        search_seconds=44, trial_steps=20, fp32_step_seconds=0.01, trials_run=2, trials_not_run=0,
    )  # fmt: skip
    trials = (outcome("amp_bf16", 150.0, True), outcome("bf16_pure", 90.0, False))
    result = TuneResult.model_construct(
        profile=types.SimpleNamespace(spec=ModeSpec(mode="amp_bf16")),
        objective="speed",
        reference=outcome("fp32", 100.0, True),
        trials=trials,
        skipped=(),
        budget=budget,
        checks_not_run=(),
        advice=(),
    )
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(tune_table(result))
    text = console.export_text()
    assert f"100.0{RETIMED_MARK}" in text and f"150.0{RETIMED_MARK}" in text
    assert f"90.0{RETIMED_MARK}" not in text and "90.0" in text
    assert "re-timed side by side" in text
    unmarked = result.model_copy(update={"trials": trials[1:]})
    unmarked = unmarked.model_copy(update={"reference": outcome("fp32", 100.0, False)})
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(tune_table(unmarked))
    assert RETIMED_MARK not in console.export_text() and "re-timed" not in console.export_text()


def test_without_re_timing_the_speed_choice_keeps_the_measured_trial_noise_and_says_so() -> None:
    """Found by a hunt: with no time left to re-time, the choice compared one trial each with
    no margin: bf16_kahan at 455 samples/s won over amp_bf16 at 426, and nothing said why."""
    from autoprec.choice import choose, unretimed_margin
    from autoprec.retiming import UNRETIMED_SPEED_MARGIN

    reference = _outcome("fp32", 100.0)
    amp, kahan = _outcome("amp_bf16", 426.0), _outcome("bf16_kahan", 455.0)
    margin, note = unretimed_margin("speed", reference, [amp, kahan])
    assert margin == UNRETIMED_SPEED_MARGIN and "speeds not re-timed" in note[0]
    assert choose([amp, kahan], reference, "speed", margin).spec.mode == "amp_bf16"
    far = _outcome("bf16_kahan", 480.0)  # 12.7% faster: beyond the measured noise
    assert choose([amp, far], reference, "speed", margin).spec.mode == "bf16_kahan"
    retimed = [o.model_copy(update={"retimed": True}) for o in (amp, kahan)]
    assert unretimed_margin("speed", reference, retimed) == (0.0, ())
    assert unretimed_margin("memory", reference, [amp, kahan]) == (0.0, ())
    # the fastest alone within re-timing's 30%: nothing was left to re-time, whatever the
    # budget (the note blamed the budget with 80% of it left; found by two hunts)
    assert unretimed_margin("speed", reference, [_outcome("amp_bf16", 300.0)]) == (0.0, ())


def test_the_re_timing_budget_counts_each_runs_fixed_cost() -> None:
    """Found by a hunt: a round's estimate left out each run's copy, conversion and warm-up
    (0.16 s estimated per re-timing run, 0.3-0.36 s taken), so a round started that the
    budget then cut: its time wasted, the choice on trial figures."""
    reference, amp = _outcome("fp32", 100.0), _outcome("amp_bf16", 110.0)
    steps = 2.5 * 30 * (reference.median_step_seconds + amp.median_step_seconds)
    timer = FakeTimer({"fp32": [100.0] * 2, "amp_bf16": [110.0] * 2})
    confirm_speed([amp], reference, steps + 1.0, lambda: 0.0, timer)
    assert len(timer.asked) == 4  # room for the steps alone: re-timed
    timer = FakeTimer({"fp32": [100.0] * 2, "amp_bf16": [110.0] * 2})
    confirm_speed([amp], reference, steps + 1.0, lambda: 0.0, timer, run_overhead=1.0)
    assert timer.asked == []  # four runs of 1 s fixed cost do not fit: not started


def test_a_budget_that_would_leave_out_a_contender_that_may_tie_re_times_none() -> None:
    """Found by a hunt: with time to re-time two of three, amp_bf16 (190, 5% behind) was left
    out and bf16_pure (200) was timed against fp32 alone and chosen; with no time at all the
    trial figures' margin chose amp_bf16. A contender within that margin is compared side by
    side or not at all; one further behind may still be left out."""
    from autoprec.choice import choose, unretimed_margin

    reference = _outcome("fp32", 100.0)
    pure, amp = _outcome("bf16_pure", 200.0), _outcome("amp_bf16", 190.0)
    two = 2.5 * 30 * (1 / 200 + 1 / 100) + 0.001  # bf16_pure and fp32 fit, not amp_bf16
    timer = FakeTimer({"bf16_pure": [200.0] * 4, "amp_bf16": [190.0] * 4, "fp32": [100.0] * 4})
    outcomes, new_reference, noise = confirm_speed(
        [pure, amp], reference, deadline=two, clock=lambda: 0.0, time_spec=timer
    )
    assert noise is None and timer.asked == [] and not any(o.retimed for o in outcomes)
    margin, _ = unretimed_margin("speed", new_reference, outcomes)
    assert choose(outcomes, new_reference, "speed", margin).spec.mode == "amp_bf16"
    slow = _outcome("amp_bf16", 150.0)  # 25% behind: within re-timing's 30%, not the margin
    timer = FakeTimer({"bf16_pure": [200.0] * 4, "amp_bf16": [150.0] * 4, "fp32": [100.0] * 4})
    outcomes, _, noise = confirm_speed(
        [pure, slow], reference, deadline=two, clock=lambda: 0.0, time_spec=timer
    )
    assert noise is not None and sorted(set(timer.asked)) == ["bf16_pure", "fp32"]


def test_a_balanced_tie_within_noise_goes_to_the_mode_closest_to_fp32() -> None:
    """Found by a hunt: balanced took the largest score however close, though a score is as
    noisy as its speed: bf16_sr won over bf16_kahan on scores 0.7% apart, each re-timed with
    10% noise."""
    from autoprec.choice import choose

    def retimed(mode: str, speed: float, memory: int) -> TrialOutcome:
        return _outcome(mode, speed).model_copy(
            update={"memory_bytes": memory, "retimed": True, "timing_noise": 0.1}
        )

    reference = retimed("fp32", 200.0, 17535668)
    kahan, sr = retimed("bf16_kahan", 200.0, 11759170), retimed("bf16_sr", 140.0, 8172000)
    assert choose([kahan, sr], reference, "balanced").spec.mode == "bf16_kahan"
    far = retimed("bf16_sr", 140.0, 5000000)  # score 2.45 against kahan's 1.49: no tie
    assert choose([kahan, far], reference, "balanced").spec.mode == "bf16_sr"
