"""Re-timing the fastest accepted modes side by side before the choice.

One trial's timing on a shared machine drifts by several percent (allocator and cache state):
the contenders within ``CONFIRM_WITHIN`` of the fastest are timed again in the order ABC then
CBA, and the means replace their trial figures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from autoprec.outcomes import TrialOutcome
from autoprec.search import PRUNE_MARGIN
from autoprec.specs import ModeSpec

logger = logging.getLogger(__name__)

CONFIRM_WITHIN = 1 - 1 / (1 + PRUNE_MARGIN)
"""Accepted modes within 15% of the fastest (samples/s) are re-timed side by side before
choosing: one trial's timing on a shared machine drifts by several percent (allocator and cache
state). The same line as the pruning race's (``search.PRUNE_MARGIN``): every mode it lets
through can be re-timed."""
CONFIRM_STEPS = 30
CONFIRM_CONTENDERS = 3


def confirm_speed(
    outcomes: list[TrialOutcome],
    reference: TrialOutcome,
    deadline: float,
    clock: Callable[[], float],
    time_spec: Callable[[ModeSpec], Any],
) -> tuple[list[TrialOutcome], TrialOutcome, float | None]:
    """Re-time the fastest accepted modes side by side (ABC then CBA) and keep the means.
    Also returns the timing noise it measured: the largest relative difference between a
    mode's two re-timings (None when nothing was re-timed)."""
    accepted = [
        o
        for o in [reference, *outcomes]
        if o.status == "accepted" and o.samples_per_second and o.median_step_seconds
    ]
    if len(accepted) < 2:
        return outcomes, reference, None
    fastest = max(o.samples_per_second or 0.0 for o in accepted)
    contenders = sorted(
        (o for o in accepted if (o.samples_per_second or 0.0) >= fastest * (1 - CONFIRM_WITHIN)),
        key=lambda o: -(o.samples_per_second or 0.0),
    )[:CONFIRM_CONTENDERS]
    needed = 2.5 * sum(CONFIRM_STEPS * (o.median_step_seconds or 0.0) for o in contenders)
    if len(contenders) < 2 or clock() + needed > deadline:
        return outcomes, reference, None
    speeds: dict[str, list[float]] = {o.label: [] for o in contenders}
    for order in (contenders, contenders[::-1]):
        for outcome in order:
            record = time_spec(outcome.spec)
            if record.completed and record.samples_per_second:
                speeds[outcome.label].append(record.samples_per_second)
    if any(len(values) < 2 for values in speeds.values()):
        return outcomes, reference, None  # the budget cut a re-timing short: trial figures
    noise = max(abs(a - b) / ((a + b) / 2) for a, b in speeds.values())

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
            }
        )

    labels = [o.label for o in contenders]
    logger.info("re-timed %s: %s (noise %.1f%%)", labels, speeds, noise * 100)
    return [confirmed(o) for o in outcomes], confirmed(reference), noise
