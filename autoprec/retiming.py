"""Re-timing the fastest accepted modes side by side before the choice.

One trial's timing on a shared machine drifts by several percent (allocator and cache state):
the contenders within ``CONFIRM_WITHIN`` (30%) of the fastest are timed again in the order ABC then
CBA (a second round when that leaves two of them within its noise), and the means replace their
trial figures. Every contender is re-timed, as many as the budget allows, fastest first; the
choice then compares re-timed figures only (``choice.choose``): a re-timing and a trial are
different measures (on our 2-core CPU, re-timings ran 2-12% below the same modes' trial
figures in 14 of 14), and a mode kept at its trial figure beat re-timed faster ones. Under the
balanced objective the contenders are ranked by its score (speed-up times memory saving). The
reference is re-timed with them: the evidence sets the chosen speed beside it, and balanced
scores divide by it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from autoprec.outcomes import Objective, TrialOutcome, balanced_gain, memory_saving
from autoprec.specs import ModeSpec

logger = logging.getLogger(__name__)

CONFIRM_WITHIN = 0.30
"""Accepted modes within 30% of the fastest (samples/s) are re-timed side by side before
choosing: one trial's timing is one measurement. Measured on GPUs: on the first H100 run a
mode's trial speed moved by up to 0.3 of itself between two runs; on the first H200 run
amp_bf16's trial in an 18-mode tune timed 1396 samples/s, 15.4% below tf32's 1649 and just
outside the 15% band used before (the pruning race's margin), so tf32 was chosen, while the
same tune on the two alone timed amp_bf16 at 1971 and chose it (tf32 1.19x its step time). On
our CPU two trials of one mode raced up to 1.09x apart (``search.PRUNE_MARGIN``'s figures).
Wider than the race's margin: every mode the race lets through is re-timed, and so is an
accepted mode whose one trial ran slow. The budget still decides how many (the slowest are
left out first)."""
CONFIRM_STEPS = 30
UNRETIMED_SPEED_MARGIN = 0.092
"""When the budget left no time to re-time, modes within 9.2% of the fastest by one trial each
count as equally fast (the one closest to fp32 wins): the largest difference between two trials
of one mode measured on our CPU (bf16_sr 1.092x, ``benchmarks.trial_timing``, 12 trials per
mode; ``search.PRUNE_MARGIN``). Without it a mode faster by a hair won over modes closer to fp32
(found by a hunt: bf16_kahan at 455 samples/s over amp_bf16 at 426, one trial each). A budget
that can re-time only some contenders re-times none when it would leave out one within this
margin of the fastest (``confirm_speed``)."""


def _timed_round(
    contenders: list[TrialOutcome], time_spec: Callable[[ModeSpec], Any]
) -> dict[str, list[float]] | None:
    """Each contender's samples/s timed in the order ABC, then CBA; None when a re-timing did
    not complete (the budget cut it short)."""
    speeds: dict[str, list[float]] = {o.label: [] for o in contenders}
    for order in (contenders, contenders[::-1]):
        for outcome in order:
            record = time_spec(outcome.spec)
            if not (record.completed and record.samples_per_second):
                return None
            speeds[outcome.label].append(record.samples_per_second)
    return speeds


def _round_noise(rounds: list[dict[str, list[float]]]) -> dict[str, float]:
    """Each mode's own timing noise. After one round: the relative difference between its two
    re-timings. After two: between its two round means (a mean of two re-timings, the quantity
    the first round compares)."""
    if len(rounds) == 1:
        return {label: abs(a - b) / ((a + b) / 2) for label, (a, b) in rounds[0].items()}
    means = [{label: sum(v) / len(v) for label, v in speeds.items()} for speeds in rounds]
    return {m: abs(means[0][m] - means[1][m]) / ((means[0][m] + means[1][m]) / 2) for m in means[0]}


def within_noise(speed: float, noise: float, fastest: float, fastest_noise: float) -> bool:
    """Is a mode at ``speed`` as fast as the fastest, within the larger of the two modes' own
    timing noises? (One noise for all, the largest of any mode's, let a slow mode's one-off
    slow re-timing put a mode 30% slower in a tie with the fastest.)"""
    return speed >= fastest * (1 - max(noise, fastest_noise))


def _undecided(
    speeds: dict[str, list[float]], noises: dict[str, float], savings: dict[str, float]
) -> bool:
    """Does a contender other than the best lie within the pair's noise of it (the choice
    then keeps the mode closest to fp32 among them)? Scored by samples/s times ``savings``
    (each mode's memory saving under the balanced objective, 1 under speed: a balanced run
    timed a second round whenever two speeds were close, though its scores were far apart)."""
    means = {label: savings[label] * sum(v) / len(v) for label, v in speeds.items()}
    best = max(means, key=lambda label: means[label])
    return any(
        within_noise(means[label], noises[label], means[best], noises[best])
        for label in means
        if label != best
    )


def _contenders(
    accepted: list[TrialOutcome], reference: TrialOutcome, objective: Objective
) -> list[TrialOutcome]:
    """The modes to re-time, best first: within ``CONFIRM_WITHIN`` of the best by the
    objective's own score (samples/s; for balanced, speed-up times memory saving), and the
    reference with them whenever two are re-timed: balanced scores divide by its speed, the
    profile's evidence sets the chosen mode's speed beside it, and a re-timed speed beside a
    trial speed mixes two measures (re-timings ran 2-12% below trials; a hunt's chosen
    amp_bf16, 1.10x fp32 by trial figures, read 390 against fp32's unre-timed 400)."""
    if objective == "balanced":
        scores = {o.label: balanced_gain(o, reference) for o in accepted}
    else:
        scores = {o.label: o.samples_per_second or 0.0 for o in accepted}
    best = max(scores.values())
    chosen = sorted(
        (o for o in accepted if scores[o.label] >= best * (1 - CONFIRM_WITHIN)),
        key=lambda o: -scores[o.label],
    )
    if (objective == "balanced" or len(chosen) >= 2) and all(o is not reference for o in chosen):
        chosen.append(reference)
    return chosen


def _may_tie(outcome: TrialOutcome, contenders: list[TrialOutcome]) -> bool:
    """Is ``outcome`` within ``UNRETIMED_SPEED_MARGIN`` of the fastest contender's trial?"""
    fastest = max(o.samples_per_second or 0.0 for o in contenders)
    return (outcome.samples_per_second or 0.0) >= fastest * (1 - UNRETIMED_SPEED_MARGIN)


def confirm_speed(
    outcomes: list[TrialOutcome],
    reference: TrialOutcome,
    deadline: float,
    clock: Callable[[], float],
    time_spec: Callable[[ModeSpec], Any],
    objective: Objective = "speed",
    run_overhead: float = 0.0,
) -> tuple[list[TrialOutcome], TrialOutcome, float | None]:
    """Re-time the fastest accepted modes side by side (ABC then CBA) and keep the means.
    Also returns the timing noise it measured (``_round_noise``; None when nothing was
    re-timed). When a contender lies within that noise of the fastest and the budget allows,
    a second round (ABC, CBA) runs and the four re-timings decide. On our 2-core CPU machines
    one round left ``make demo`` on fp32 in 4 of 25 fresh runs by one slow re-timing (11-24%
    noise) where amp_bf16 usually runs 1.1-1.3x faster. ``run_overhead``: a run's fixed cost
    beyond its steps (calibration's), counted in the budget check once per re-timing run."""
    accepted = [
        o
        for o in [reference, *outcomes]
        if o.status == "accepted" and o.samples_per_second and o.median_step_seconds
    ]
    if len(accepted) < 2:
        return outcomes, reference, None
    contenders = _contenders(accepted, reference, objective)

    def needed() -> float:
        # two orders, half again, and each run's fixed cost (``run_overhead``: copying,
        # converting, warm-up), which a round started with half of it left could not finish
        # (found by a hunt: 0.16 s estimated per re-timing run, 0.3-0.36 s taken)
        return sum(
            2.5 * CONFIRM_STEPS * (o.median_step_seconds or 0.0) + 2 * run_overhead
            for o in contenders
        )

    while len(contenders) > 2 and clock() + needed() > deadline:
        # the lowest scored: those left out lost to every contender in the trials (the
        # reference is kept: the evidence and balanced scores compare with it)
        dropped = next(o for o in reversed(contenders) if o is not reference)
        if objective == "speed" and _may_tie(dropped, contenders):
            # left out, it could not be chosen, though it may be as fast as the fastest and
            # closer to fp32 (found by a hunt: amp_bf16 at 190 dropped, bf16_pure at 200 timed
            # against fp32 alone and chosen): compared side by side or not at all, where the
            # trial figures decide with UNRETIMED_SPEED_MARGIN
            return outcomes, reference, None
        contenders.remove(dropped)
    if len(contenders) < 2 or clock() + needed() > deadline:
        return outcomes, reference, None
    first = _timed_round(contenders, time_spec)
    if first is None:
        return outcomes, reference, None  # the budget cut a re-timing short: trial figures
    speeds, noises = first, _round_noise([first])
    savings = {
        o.label: memory_saving(o, reference) if objective == "balanced" else 1.0 for o in contenders
    }
    if _undecided(first, noises, savings) and clock() + needed() <= deadline:
        second = _timed_round(contenders, time_spec)
        if second is not None:
            speeds = {label: first[label] + second[label] for label in first}
            noises = _round_noise([first, second])

    def confirmed(outcome: TrialOutcome) -> TrialOutcome:
        if outcome.label not in speeds:
            return outcome
        values = speeds[outcome.label]
        samples = sum(values) / len(values)
        ratio = (outcome.samples_per_second or samples) / samples
        return outcome.model_copy(
            update={
                "samples_per_second": samples,
                "tokens_per_second": None
                if outcome.tokens_per_second is None
                else outcome.tokens_per_second / ratio,
                "median_step_seconds": (outcome.median_step_seconds or 0.0) * ratio,
                "retimed": True,
                "timing_noise": noises[outcome.label],
            }
        )

    labels = [o.label for o in contenders]
    logger.info("re-timed %s: %s (noise %s)", labels, speeds, noises)
    return [confirmed(o) for o in outcomes], confirmed(reference), max(noises.values())
