"""Accepted outcomes -> the Pareto front (speed up, memory down) and the winner."""

from __future__ import annotations

from collections.abc import Sequence

from autoprec.outcomes import Objective, TrialOutcome, balanced_gain
from autoprec.retiming import CONFIRM_WITHIN, UNRETIMED_SPEED_MARGIN, within_noise


def _key(outcome: TrialOutcome) -> tuple[float, float]:
    return outcome.samples_per_second or 0.0, float(outcome.memory_bytes or 0)


def dominates(a: TrialOutcome, b: TrialOutcome) -> bool:
    """``a`` is at least as fast and as lean as ``b``, and strictly better in one."""
    (speed_a, memory_a), (speed_b, memory_b) = _key(a), _key(b)
    return (
        speed_a >= speed_b and memory_a <= memory_b and (speed_a, memory_a) != (speed_b, memory_b)
    )


def pareto_front(outcomes: Sequence[TrialOutcome]) -> list[TrialOutcome]:
    """Accepted outcomes no other accepted outcome dominates, fastest first."""
    accepted = [o for o in outcomes if o.status == "accepted" and o.samples_per_second]
    front = [o for o in accepted if not any(dominates(other, o) for other in accepted)]
    return sorted(front, key=lambda o: -(o.samples_per_second or 0.0))


FIDELITY_ORDER = (
    "fp32", "tf32", "amp_bf16", "amp_fp16", "fp8_te", "fp8_torchao", "bf16_sr_kahan",
    "bf16_kahan", "bf16_sr", "bf16_pure",
)  # fmt: skip
"""Modes from closest to fp32 to farthest: how much of training leaves fp32 (TF32: matmul
inputs; AMP: activations, with fp32 weights and states; FP8: matmul operands in 8 bits; pure
bf16: the weights, with compensation first). 8-bit optimizer states come after their 32-bit
twin."""


def fidelity_rank(outcome: TrialOutcome) -> tuple[int, int]:
    """Sort key: lower is closer to fp32."""
    return FIDELITY_ORDER.index(outcome.spec.mode), outcome.spec.optimizer_bits == 8


def _noise(outcome: TrialOutcome) -> float:
    return outcome.timing_noise or 0.0


def choose(
    outcomes: Sequence[TrialOutcome],
    reference: TrialOutcome,
    objective: Objective,
    speed_margin: float = 0.0,
) -> TrialOutcome:
    """The winner among accepted outcomes (the reference counts), for ``objective``.

    speed: highest samples/s (less memory breaks ties) — but among the modes within timing
    noise of the fastest (the larger of the two modes' own re-timing noise,
    ``TrialOutcome.timing_noise``; ``speed_margin`` a floor under it), the one closest to fp32
    (``FIDELITY_ORDER``): a difference inside the noise is no reason to leave fp32 further;
    when modes were re-timed (``TrialOutcome.retimed``), among those only;
    memory: least memory (more speed breaks ties); balanced: largest product of speed-up and
    memory saving against the reference, among the re-timed modes when any was (the
    reference is re-timed with them for balanced: ``retiming``), the one closest to fp32
    among the scores within noise of the best, as under speed.
    """
    pool = [o for o in [reference, *outcomes] if o.status == "accepted" and o.samples_per_second]
    if not pool:
        return reference
    if any(o.retimed for o in pool):  # like with like (memory re-times none)
        pool = [o for o in pool if o.retimed]
    if objective == "speed":
        top = max(pool, key=lambda o: o.samples_per_second or 0.0)
        fastest, top_noise = top.samples_per_second or 0.0, max(speed_margin, _noise(top))
        close = [
            o
            for o in pool
            if within_noise(o.samples_per_second or 0.0, _noise(o), fastest, top_noise)
        ]
        return min(close, key=lambda o: (fidelity_rank(o), -(o.samples_per_second or 0.0)))
    if objective == "memory":
        return min(pool, key=lambda o: (o.memory_bytes or 0, -(o.samples_per_second or 0.0)))
    # balanced: a score is a speed times an exact memory saving, as noisy as the speed; within
    # that noise the mode closest to fp32 wins, as under speed (found by a hunt: bf16_sr
    # chosen over bf16_kahan on scores 0.7% apart, both re-timed with 10% noise)
    top = max(pool, key=lambda o: balanced_gain(o, reference))
    best, top_noise = balanced_gain(top, reference), max(speed_margin, _noise(top))
    close = [
        o for o in pool if within_noise(balanced_gain(o, reference), _noise(o), best, top_noise)
    ]
    return min(close, key=lambda o: (fidelity_rank(o), -balanced_gain(o, reference)))


def unretimed_margin(
    objective: Objective, reference: TrialOutcome, outcomes: Sequence[TrialOutcome]
) -> tuple[float, tuple[str, ...]]:
    """(the speed choice's margin, the note saying so) when no contender was re-timed: tune()'s
    choice and ``autoprec report``'s of a study (which chose without it; found by a hunt)."""
    accepted = [
        o for o in (reference, *outcomes) if o.status == "accepted" and o.samples_per_second
    ]
    if objective != "speed" or len(accepted) < 2 or any(o.retimed for o in accepted):
        return 0.0, ()
    fastest = max(o.samples_per_second or 0.0 for o in accepted)
    close = [o for o in accepted if (o.samples_per_second or 0.0) >= fastest * (1 - CONFIRM_WITHIN)]
    if len(close) < 2:  # the fastest led by more than re-timing looks at: nothing to re-time
        return 0.0, ()  # (the note said "the budget left no time" with 80% of it left)
    return UNRETIMED_SPEED_MARGIN, (
        "speeds not re-timed (the budget left no time for it): the choice compares one trial "
        f"each and counts modes within {UNRETIMED_SPEED_MARGIN:.1%} of the fastest as equally "
        "fast (the largest trial-to-trial difference measured on our CPU); a larger budget "
        "re-times the leaders side by side",
    )
