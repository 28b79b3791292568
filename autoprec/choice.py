"""Accepted outcomes -> the Pareto front (speed up, memory down) and the winner."""

from __future__ import annotations

from collections.abc import Sequence

from autoprec.search import Objective, TrialOutcome


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


def choose(
    outcomes: Sequence[TrialOutcome], reference: TrialOutcome, objective: Objective
) -> TrialOutcome:
    """The winner among accepted outcomes (the reference counts), for ``objective``.

    speed: highest samples/s (less memory breaks ties); memory: least memory (more speed breaks
    ties); balanced: largest product of speed-up and memory saving against the reference.
    """
    pool = [o for o in [reference, *outcomes] if o.status == "accepted" and o.samples_per_second]
    if not pool:
        return reference
    if objective == "speed":
        return max(pool, key=lambda o: (o.samples_per_second or 0.0, -(o.memory_bytes or 0)))
    if objective == "memory":
        return min(pool, key=lambda o: (o.memory_bytes or 0, -(o.samples_per_second or 0.0)))
    reference_speed = reference.samples_per_second or 1.0
    reference_memory = reference.memory_bytes or 1

    def gain(o: TrialOutcome) -> float:
        speedup = (o.samples_per_second or 0.0) / reference_speed
        saving = reference_memory / max(o.memory_bytes or reference_memory, 1)
        return speedup * saving

    return max(pool, key=gain)
