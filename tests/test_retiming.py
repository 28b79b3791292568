"""confirm_speed: which modes are re-timed, in what order, and what replaces their figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autoprec.outcomes import TrialOutcome
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
    fp16 = _outcome("amp_fp16", 200.0 * (1 - CONFIRM_WITHIN) + 1)  # within 15%: a contender
    pure = _outcome("bf16_pure", 300.0, status="rejected")  # not accepted: never re-timed
    timer = FakeTimer({"amp_bf16": [180.0, 190.0], "amp_fp16": [200.0, 210.0]})

    outcomes, new_reference, noise = confirm_speed(
        [bf16, fp16, pure], reference, deadline=1e9, clock=lambda: 0.0, time_spec=timer
    )

    assert timer.asked == ["amp_bf16", "amp_fp16", "amp_fp16", "amp_bf16"]  # ABC then CBA
    assert new_reference == reference  # fp32 at half the speed is no contender
    by_mode = {o.spec.mode: o for o in outcomes}
    assert by_mode["amp_bf16"].samples_per_second == pytest.approx(185.0)
    assert by_mode["amp_fp16"].samples_per_second == pytest.approx(205.0)
    # tokens/s and step time scale with the new speed
    assert by_mode["amp_bf16"].tokens_per_second == pytest.approx(1850.0)
    assert by_mode["amp_bf16"].median_step_seconds == pytest.approx(1 / 185.0)
    assert by_mode["bf16_pure"] == pure
    assert noise == pytest.approx(max(10 / 185, 10 / 205))


def test_nothing_is_retimed_without_two_contenders_or_time_for_them() -> None:
    reference = _outcome("fp32", 100.0)
    fast = _outcome("amp_bf16", 200.0)
    timer = FakeTimer({})
    alone = confirm_speed([fast], reference, deadline=1e9, clock=lambda: 0.0, time_spec=timer)
    assert alone == ([fast], reference, None)  # fp32 is more than 15% slower: no contest

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
