"""The drift gate's weight-movement check: how much of fp32's movement reached the weights.

In each lr leg the trial's movement is projected onto the fp32 reference's (a Kahan buffer counts
as part of its weight), and judged against the paired fp32 run's projection (another seed, the
same batches): what faithful fp32 training reaches when only the model's random draws differ.
This catches pure bf16 at small learning rates while its loss still looks fine (../seeds).
Beside it, a note when pure bf16's weight decay rounds away entirely (``decay_note``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from autoprec.drift_thresholds import DriftThresholds
from autoprec.modes import MODE_CLASSES
from autoprec.modes.pure_bf16 import Bf16PureMode
from autoprec.recipe import LrPoint
from autoprec.specs import ModeSpec
from autoprec.trial_records import TrialResult


class LegMovement(NamedTuple):
    """The movement check's figures for one lr leg and one lr class of parameter groups."""

    point: LrPoint | None
    groups: tuple[int, ...] | None
    """The parameter groups judged together (those sharing this leg's lr); None: all."""
    fraction: float
    """Projection of the trial's movement onto the reference's (1.0: all of it arrived)."""
    never_moved: float
    """Share of the weights the reference moved that the trial never moved."""

    def describe(self, legs: int, classes: int) -> str:
        """Where this figure was taken, for a message (empty for a single leg and class)."""
        if self.point is None or (legs == 1 and classes == 1):
            return ""
        # the judged groups' own lr: group 0's was quoted (a frozen backbone's 0.01, or a
        # backbone's 0, for a head trained at 1e-5; found by a hunt)
        at = self.point.describe(self.groups[0] if self.groups else 0)
        if self.groups is None or classes == 1:
            return f" at {at}"
        named = ", ".join(str(group) for group in self.groups)
        plural = "s" if len(self.groups) > 1 else ""
        return f" in parameter group{plural} {named} at {at}"


def _movement(
    trial: dict[str, torch.Tensor],
    trial_start: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    reference_start: dict[str, torch.Tensor],
    names: list[str],
) -> tuple[float, float] | None:
    """(projection of the trial's movement onto the reference's, share of weights the
    reference moved that the trial never moved) over the tensors ``names``; None when the
    reference did not move them."""
    dot = norm = 0.0
    reference_moved = trial_still = 0
    for name in names:
        if name not in trial or name not in trial_start:
            return None
        intended = reference[name] - reference_start[name]
        actual = trial[name] - trial_start[name]
        dot += float(torch.dot(actual, intended))
        norm += float(torch.dot(intended, intended))
        moved = intended != 0
        reference_moved += int(moved.sum())
        trial_still += int((moved & (actual == 0)).sum())
    if norm == 0:
        return None
    return dot / norm, trial_still / max(reference_moved, 1)


def _lr_classes(
    names: list[str], groups: dict[str, int], point: LrPoint | None
) -> list[tuple[tuple[int, ...] | None, list[str]]]:
    """The sampled tensors split by their parameter group's lr in this leg, groups of equal lr
    pooled, smallest lr first: rounding loss follows the lr (an MLP under AdamW, 150-step
    trials on our CPU machines: pure bf16 kept 0.994 of fp32's movement at lr 1e-3, 0.078 at
    3e-5), so a backbone at 1e-5 beside a head at 1e-2 is judged apart, not drowned in the
    head's movement. One class when every group shares the lr or the groups are unknown. Trainable
    tensors in no group (left out of the optimizer: no step moves them) join no class."""
    if point is None or not groups:
        return [(None, names)]
    by_lr: dict[float, list[str]] = {}
    for name in names:
        if name in groups:
            by_lr.setdefault(point.lrs[groups[name]], []).append(name)
    if len(by_lr) <= 1:  # one class: its groups still say whose lr it trained at
        held = tuple(sorted({groups[name] for name in names if name in groups}))
        return [(held or None, names)]
    return [
        (tuple(sorted({groups[name] for name in members})), members)
        for _, members in sorted(by_lr.items())
    ]


def leg_movements(trial: TrialResult, reference: TrialResult) -> list[LegMovement]:
    """Per lr leg and lr class of parameter groups, the movement check's figures. Legs (and
    classes) the reference did not move in are left out (:func:`still_legs` names them); a
    trial with other legs than the reference's has none."""
    return _split(_legs(trial, reference))[0]


def still_legs(trial: TrialResult, reference: TrialResult) -> list[LegMovement]:
    """The legs and lr classes at a nonzero lr where the reference moved no sampled weight
    (no gradient there: a hinge loss at 0; or updates below fp32's precision), so movement
    was not judged; they were left out without a word (found by a hunt)."""
    return _split(_legs(trial, reference))[1]


def _split(legs: list[LegMovement]) -> tuple[list[LegMovement], list[LegMovement]]:
    """(the legs the reference moved in, those at a nonzero lr it did not move in)."""
    moved = [leg for leg in legs if not math.isnan(leg.fraction)]
    still = [
        leg
        for leg in legs
        if math.isnan(leg.fraction)
        and leg.point is not None
        and any(leg.point.lrs[group] for group in (leg.groups or range(len(leg.point.lrs))))
    ]
    return moved, still


def _legs(trial: TrialResult, reference: TrialResult) -> list[LegMovement]:
    """Every leg and lr class, NaN figures where the reference moved no sampled weight (one
    the trial lacks figures for is left out)."""
    ours, theirs = trial.leg_weights, reference.leg_weights
    points = reference.record.lr_points
    if len(ours) != len(theirs) or len(ours) < 2 or trial.record.lr_points != points:
        return []
    found = []
    names = list(theirs[0])
    nan = float("nan")
    for leg in range(len(ours) - 1):
        point = points[leg] if leg < len(points) else None
        for groups, members in _lr_classes(names, reference.parameter_groups, point):
            movement = _movement(ours[leg + 1], ours[leg], theirs[leg + 1], theirs[leg], members)
            if movement is not None:
                found.append(LegMovement(point, groups, *movement))
            elif all(torch.equal(theirs[leg + 1][n], theirs[leg][n]) for n in members):
                found.append(LegMovement(point, groups, nan, nan))  # the reference stood still
    return found


MIN_PAIRED_MOVEMENT = 0.25
"""Below this projection of the paired fp32 run onto the reference's movement, random draws
dominate the trajectory and the movement check is not run (said in the verdict's notes)."""


_UNBIASED_ROUNDING = ("bf16_sr", "bf16_kahan", "bf16_sr_kahan")


def _shortfall(spec: ModeSpec, never_moved: float, forward_too_costly: bool) -> tuple[str, str]:
    """(what a movement shortfall is called, what caused it) for this mode: only bf16 weights
    round updates away. Under a mode that keeps fp32 weights (AMP, FP8, 8-bit states) the
    shortfall is the mode's forward, gradients or optimizer state changing the updates' size or
    direction (on an H200, FP8 tensorwise on a 59M-parameter GPT took 79% of fp32's movement at
    a cosine schedule's floor lr, and was called "lost to rounding"). Under stochastic rounding
    or Kahan summation with no weight left standing, nothing was lost on average either: at
    the edge of stability (SGD at lr 0.178 on an MLP, its loss swinging 0.08-3.8) bf16_sr and
    bf16_kahan took 49% and 68% of fp32's movement, amp_bf16 53%, and were called "lost to
    rounding" (found by a hunt). Where the mode's forward alone costs beyond its line, bf16
    weights are not named either: a NeRF whose sin/cos(2^10 pi x) encoding ran in bf16 (forward
    cost +121%) took 78% of fp32's movement under bf16_sr, called "lost to rounding", and 99.7%
    once the encoding was kept in fp32, 0.7% of its weights still standing (a hunt)."""
    if forward_too_costly:
        return (
            "weight movement short of fp32's",
            "; the mode's forward alone also costs beyond its line (another reason here), so "
            "its gradients are not fp32's: the shortfall may be the forward's as much as any "
            "rounding's",
        )
    if spec.mode in _UNBIASED_ROUNDING and never_moved <= 0.005:  # what reads "0%" beside it
        return (
            "weight movement short of fp32's",
            "; at most 0.5% of the weights the reference moved stood still, and stochastic "
            "rounding and Kahan summation lose no update on average: the bf16 weights' "
            "rounding noise steered the run elsewhere, as any perturbation steers a run at the "
            "edge of stability",
        )
    if issubclass(MODE_CLASSES[spec.mode], Bf16PureMode):
        return "updates lost to rounding", ""
    return (
        "weight movement short of fp32's",
        "; the weights stay fp32, so no update was rounded away: the mode's forward, gradients "
        "or optimizer state changed the updates",
    )


def movement_checks(
    trial: TrialResult,
    reference: TrialResult,
    paired: TrialResult | None,
    limits: DriftThresholds,
    metrics: dict[str, float | None],
    paired_label: str = "a second fp32 run with other random draws",
    *,
    forward_too_costly: bool = False,
) -> tuple[list[str], list[str]]:
    """(reasons, notes) of the weight-movement check, leg by leg and lr class by lr class: the
    trial's projection onto the reference's movement, relative to the paired fp32 run's (1
    without one), which ``paired_label`` names in them (found by a hunt: "other random draws"
    was said of the run from nudged weights too, which draws the reference's).
    ``forward_too_costly``: the forward-cost check rejected the same trial (see
    :func:`_shortfall`)."""
    legs, still = _split(_legs(trial, reference))  # once: each leg's projection is a pass
    count = len({leg.point for leg in legs + still}), len({leg.groups for leg in legs + still})
    still_notes = [
        f"weight movement not judged{leg.describe(*count)}: the fp32 reference moved no "
        "weight there (no gradient there, or updates below fp32's own precision)"
        for leg in still
    ]
    if not legs:
        return [], still_notes
    ceilings = [1.0] * len(legs)
    if paired is not None:
        paired_legs = leg_movements(paired, reference)
        if [(leg.point, leg.groups) for leg in paired_legs] == [
            (leg.point, leg.groups) for leg in legs
        ]:
            ceilings = [leg.fraction for leg in paired_legs]
    judged = list(zip(legs, ceilings, strict=True))
    # the figures of a leg the check judges (found by a hunt: a floor leg left unjudged for
    # its paired run's 10% gave the metrics while the reason named the peak leg)
    weighed = [item for item in judged if item[1] >= MIN_PAIRED_MOVEMENT] or judged
    weakest, ceiling = min(weighed, key=lambda item: item[0].fraction / max(item[1], 1e-12))
    metrics["update_fraction"] = weakest.fraction
    metrics["never_moved_fraction"] = weakest.never_moved
    metrics["update_fraction_noise"] = ceiling if paired is not None else None
    metrics["update_fraction_lr"] = (
        None if weakest.point is None else weakest.point.lrs[(weakest.groups or (0,))[0]]
    )
    leg_count = len({leg.point for leg in legs})
    class_count = len({leg.groups for leg in legs})
    reasons, notes = [], still_notes
    for leg, ceiling in judged:
        shortfall, cause = _shortfall(trial.record.spec, leg.never_moved, forward_too_costly)
        at = leg.describe(leg_count, class_count)
        if ceiling < MIN_PAIRED_MOVEMENT:
            notes.append(
                f"weight movement not judged{at}: {paired_label} takes only {ceiling:.0%} of "
                "the reference's movement (its own noise dominates)"
            )
        elif leg.fraction < limits.min_update_fraction * ceiling:
            paired_said = f"; {paired_label} reaches {ceiling:.0%}" if paired is not None else ""
            reasons.append(
                f"{shortfall}{at}: only {leg.fraction:.0%} of the fp32 weight movement reached "
                f"the weights ({leg.never_moved:.0%} of weights the reference moved never "
                f"moved{paired_said}{cause})"
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
    return [  # the smallest of the groups' (found by a hunt: "every decayed weight" was said
        # with a head group's 5e-3 applying)
        f"weight decay never applies: lr x weight_decay = {decay:.2g} a step at the peak lr "
        "(the smallest of the parameter groups'), below half a bf16 ulp "
        f"({HALF_BF16_ULP:.2g} of a weight), so nearest rounding returns every weight it "
        "decays unchanged; bf16_kahan, bf16_sr and bf16_sr_kahan apply it"
    ]
