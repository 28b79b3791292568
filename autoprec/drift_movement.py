"""The drift gate's weight-movement check: how much of fp32's movement reached the weights.

In each lr leg the trial's movement is projected onto the fp32 reference's (a Kahan buffer counts
as part of its weight), and judged against the paired fp32 run's projection (another seed, the
same batches): what faithful fp32 training reaches when only the model's random draws differ.
This catches pure bf16 at small learning rates while its loss still looks fine (../seeds).
Beside it, a note when pure bf16's weight decay rounds away entirely (``decay_note``).
"""

from __future__ import annotations

import torch

from autoprec.drift_thresholds import DriftThresholds
from autoprec.recipe import LrPoint
from autoprec.trial_records import TrialResult


def _movement(
    trial: dict[str, torch.Tensor],
    trial_start: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    reference_start: dict[str, torch.Tensor],
) -> tuple[float, float] | None:
    """(projection of the trial's movement onto the reference's, share of weights the
    reference moved that the trial never moved); None when the reference did not move."""
    dot = norm = 0.0
    reference_moved = trial_still = 0
    for name, start in reference_start.items():
        if name not in trial or name not in trial_start:
            return None
        intended = reference[name] - start
        actual = trial[name] - trial_start[name]
        dot += float(torch.dot(actual, intended))
        norm += float(torch.dot(intended, intended))
        moved = intended != 0
        reference_moved += int(moved.sum())
        trial_still += int((moved & (actual == 0)).sum())
    if norm == 0:
        return None
    return dot / norm, trial_still / max(reference_moved, 1)


def leg_movements(
    trial: TrialResult, reference: TrialResult
) -> list[tuple[LrPoint | None, float, float]]:
    """Per lr leg: (its lr point, update fraction, never-moved share). Legs the reference did
    not move in are left out; a trial with other legs than the reference's has none."""
    ours, theirs = trial.leg_weights, reference.leg_weights
    points = reference.record.lr_points
    if len(ours) != len(theirs) or len(ours) < 2 or trial.record.lr_points != points:
        return []
    found = []
    for leg in range(len(ours) - 1):
        movement = _movement(ours[leg + 1], ours[leg], theirs[leg + 1], theirs[leg])
        if movement is not None:
            point = points[leg] if leg < len(points) else None
            found.append((point, *movement))
    return found


MIN_PAIRED_MOVEMENT = 0.25
"""Below this projection of the paired fp32 run onto the reference's movement, random draws
dominate the trajectory and the movement check is not run (said in the verdict's notes)."""


def movement_checks(
    trial: TrialResult,
    reference: TrialResult,
    paired: TrialResult | None,
    limits: DriftThresholds,
    metrics: dict[str, float | None],
) -> tuple[list[str], list[str]]:
    """(reasons, notes) of the weight-movement check, leg by leg: the trial's projection onto
    the reference's movement, relative to the paired fp32 run's (1 without one)."""
    legs = leg_movements(trial, reference)
    if not legs:
        return [], []
    ceilings = [1.0] * len(legs)
    if paired is not None:
        paired_legs = leg_movements(paired, reference)
        if len(paired_legs) == len(legs):
            ceilings = [fraction for _, fraction, _ in paired_legs]
    judged = list(zip(legs, ceilings, strict=True))
    weakest, ceiling = min(judged, key=lambda item: item[0][1] / max(item[1], 1e-12))
    point, metrics["update_fraction"], metrics["never_moved_fraction"] = weakest
    metrics["update_fraction_noise"] = ceiling if paired is not None else None
    metrics["update_fraction_lr"] = None if point is None else point.lr
    reasons, notes = [], []
    for (point, fraction, never), ceiling in judged:
        at = "" if point is None or len(legs) == 1 else f" at {point.describe()}"
        if ceiling < MIN_PAIRED_MOVEMENT:
            notes.append(
                f"weight movement not judged{at}: a second fp32 run with other random draws "
                f"takes only {ceiling:.0%} of the reference's movement (random draws dominate)"
            )
        elif fraction < limits.min_update_fraction * ceiling:
            paired_said = (
                f"; a second fp32 run with other random draws reaches {ceiling:.0%}"
                if paired is not None
                else ""
            )
            reasons.append(
                f"updates lost to rounding{at}: only {fraction:.0%} of the fp32 weight "
                f"movement reached the weights ({never:.0%} of weights the reference moved "
                f"never moved{paired_said})"
            )
    return reasons, notes


HALF_BF16_ULP = 2.0**-9
"""Half a bf16 ulp relative to any weight is at least 2**-9 (2**-9 to 2**-8 of its magnitude):
a multiply by ``1 - x`` with ``x`` below it returns every bf16 weight unchanged."""


def decay_note(trial: TrialResult) -> list[str]:
    """A note when the user's decoupled weight decay never applies: bf16 weights multiplied by
    ``1 - lr * wd`` and rounded to nearest are returned unchanged when ``lr * wd`` is below
    half a bf16 ulp (measured on the ground truth's conv net: pure bf16 runs with weight decay
    0.01 and 0 were identical to the last bit). Not a rejection: the long runs found no harm
    from it alone (fp32 without decay ended as fp32 with it there)."""
    decay = trial.record.nearest_rounded_decay
    if decay is None or decay >= HALF_BF16_ULP:
        return []
    return [
        f"weight decay never applies: lr x weight_decay = {decay:.2g} a step at the peak lr, "
        f"below half a bf16 ulp ({HALF_BF16_ULP:.2g} of a weight), so nearest rounding returns "
        "every decayed weight unchanged; bf16_kahan, bf16_sr and bf16_sr_kahan apply it"
    ]
