"""The drift gate: accept a mode only when its short trial does not drift from fp32.

Reference: the fp32 trial. Every metric is judged against the same metric measured on a second
fp32 run, so that a bar never sits inside the noise:

- losses and ``eval_fn``: the **noise run**, another seed and another batch order (what another
  run of the user's own training gives), with floors for deterministic models (noise ~0);
- weight movement and held-out outputs, which compare trajectories on the same batches: the
  **paired run**, another seed and the same batch order, so that only the model's own random
  draws (dropout, noise in a diffusion loss) differ. For a model that draws no random numbers
  (such a run would repeat the reference exactly) the paired run starts from weights nudged by
  2^-12 (a quarter of an fp16 ulp, ``model_copies.NUDGE``): a training run that is not chaotic stays
  within ~0 of the reference and the floors apply; a chaotic one drifts as far as chaos takes
  it, and that is its noise.

Beyond training loss the gate checks what loss hides (../seeds: pure bf16 diffusion training
with a normal loss curve and garbage images): how much of the reference's weight movement
actually reached the weights (a Kahan buffer counts as part of its weight; stochastic rounding
and Kahan are judged by accumulated movement, not by the per-step "unchanged" share, which is
high for them too), output agreement on held-out batches, fp16 range and loss-scaler health,
and the user's own ``eval_fn``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from pydantic import BaseModel

from autoprec._models import FROZEN_RECORD
from autoprec.drift_fp16 import fp16_risks
from autoprec.drift_movement import decay_note, movement_checks
from autoprec.drift_outside_state import outside_state_reasons
from autoprec.drift_state_rule import state_rule_reasons
from autoprec.drift_thresholds import DriftThresholds
from autoprec.specs import PURE_BF16_MODES
from autoprec.trial_records import OutputSummary, TrialRecord, TrialResult, sample_stride


@dataclass(frozen=True)
class Fp32Runs:
    """The fp32 runs every trial is judged against (see the module docstring)."""

    reference: TrialResult
    noise: TrialResult
    """Another seed and another batch order: the loss and eval_fn noise."""
    paired: TrialResult | None = None
    """The same batch order, another seed (or, when the reference drew no random numbers,
    weights nudged by 2^-12): the movement and output noise. None in a reference cache
    written before the nudged run existed."""
    nudged: TrialResult | None = None
    """Models with random draws only: the same seed (the reference's draws) from weights nudged
    by 2^-12, the movement and output noise of a trial that drew the reference's random
    numbers (chaotic training drifts even then). None for a model without draws (``paired`` is
    that run) and in a reference cache written before it existed."""

    @property
    def noise_runs(self) -> int:
        return 1 + sum(run is not None for run in (self.paired, self.nudged))

    def judge(self, trial: TrialResult, thresholds: DriftThresholds | None) -> DriftVerdict:
        return judge(
            trial,
            self.reference,
            self.noise,
            thresholds,
            paired=self.paired,
            nudged=self.nudged,
        )


class DriftMetrics(BaseModel):
    model_config = FROZEN_RECORD

    noise_floor: float | None = None
    heldout_loss_gap: float | None = None
    late_loss_gap: float | None = None
    update_fraction: float | None = None
    """Projection of the trial's weight movement onto the reference's (1.0 = all arrived), in
    the lr leg where it is lowest."""
    update_fraction_noise: float | None = None
    """The paired fp32 run's projection in that leg (what faithful fp32 training reaches)."""
    update_fraction_lr: float | None = None
    """The learning rate of that leg."""
    never_moved_fraction: float | None = None
    """Share of sampled weights the reference moved but the trial never did (same leg)."""
    output_error: float | None = None
    output_error_noise: float | None = None
    output_error_centered: float | None = None
    """The output error with each row's mean over a class dimension removed (see
    ``_output_check``); None without a class dimension."""
    output_error_centered_noise: float | None = None
    top1_agreement: float | None = None
    skipped_step_rate: float | None = None
    rounded_beta2: float | None = None
    """beta2 of a second moment kept in bf16 with nearest rounding, or of the Adam that trains
    bf16_pure's nearest-rounded weights with 8-bit states (see ``drift_state_rule``)."""
    eval_gap: float | None = None
    forward_cost: float | None = None
    """The mode's forward pass alone, relative: held-out loss of the trial's own weights in the
    mode over the same weights read in fp32, minus 1 (see DriftThresholds.max_forward_cost)."""
    forward_cost_absolute: float | None = None
    """The same difference in loss units: what the loss floor (``loss_floor_units``) judges
    near a loss of zero."""
    forward_cost_line: float | None = None
    """The cost allowed, in loss units: ``max_forward_cost`` of the fp32 read's mean, or the
    loss floor where that is larger (then the cost is shown in loss units, not as a share)."""
    loss_floor_units: float | None = None
    """The loss checks' floor in loss units: ``loss_floor_start`` of the reference's first
    training loss, or ``loss_floor_absolute`` where that is larger."""

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class DriftVerdict(BaseModel):
    model_config = FROZEN_RECORD

    accepted: bool
    reasons: tuple[str, ...]
    metrics: DriftMetrics
    notes: tuple[str, ...] = ()
    """Checks that could not run, and why (no held-out batches, no outputs to compare), and
    what the trial found without rejecting it (weight decay that rounds away)."""


def loss_floor_units(reference: TrialRecord, thresholds: DriftThresholds) -> float:
    """The floor of the loss checks that does not scale with the loss's current mean: a share
    of where the reference's loss started, or the absolute floor (see DriftThresholds)."""
    first = reference.losses[0] if reference.losses else 0.0
    start = abs(first) if math.isfinite(first) else 0.0
    return max(thresholds.loss_floor_absolute, thresholds.loss_floor_start * start)


def loss_scale(reference: TrialRecord, mean: float, late_fraction: float) -> float:
    """What the loss checks' and the forward cost's 1% shares are taken of: the loss's
    ``mean``, or, for a loss the reference saw go negative, at least how far it fell (its
    first ``late_fraction`` of training steps' mean against ``mean``). A loss that goes
    negative has no meaningful zero (a density's negative log-likelihood, whose zero the data's
    units set), so a mean near 0 is no scale: a normalizing flow whose held-out NLL sat at
    0.017 in one choice of units rejected amp_bf16 for "+3.81%" and passed it at a mean of
    -0.149 in units 2% apart, for the same cost of 0.0007 nats (found by a hunt). At least:
    the fall alone collapsed on a loss that hardly moves in a trial (a review), so the mean
    still counts. A loss that never goes negative keeps its mean: an exact fit's falls to 0
    for real, and a precision floor there is a real cost (``loss_floor_start``)."""
    level = abs(mean)
    finite = [v for v in (*reference.losses, *reference.heldout_losses) if math.isfinite(v)]
    if not finite or min(finite) >= 0 or not math.isfinite(mean):
        return level
    first = reference.losses[: max(1, int(len(reference.losses) * late_fraction))]
    early = [v for v in first if math.isfinite(v)]
    fell = abs(statistics.fmean(early) - mean) if early else 0.0
    return max(level, fell)


def noise_floor(reference: TrialResult, noise: TrialResult, thresholds: DriftThresholds) -> float:
    """Loss units one fp32 run differs from another, floored (see DriftThresholds)."""
    ref, other = reference.record.heldout_losses, noise.record.heldout_losses
    in_units = loss_floor_units(reference.record, thresholds)
    if not ref:  # no held-out batches: the late training windows, averaged over their batches
        late = max(1, int(len(reference.record.losses) * thresholds.late_fraction))
        ref, other = reference.record.losses[-late:], noise.record.losses[-late:]
        scale = (
            loss_scale(reference.record, statistics.fmean(ref), thresholds.late_fraction)
            if ref
            else 0.0
        )
        floor = max(in_units, thresholds.loss_floor_relative * scale)
        # the noise run trains on another batch order: step-paired losses are of different
        # batches, so compare the windows' means, not their last losses
        if not ref or not other:
            return floor
        return max(floor, abs(statistics.fmean(other) - statistics.fmean(ref)))
    scale = loss_scale(reference.record, statistics.fmean(ref), thresholds.late_fraction)
    floor = max(in_units, thresholds.loss_floor_relative * scale)
    if len(other) != len(ref):
        return floor
    differences = [b - a for a, b in zip(ref, other, strict=True)]
    spread = abs(statistics.fmean(differences))
    if len(differences) > 1:
        spread = max(spread, statistics.stdev(differences) / math.sqrt(len(differences)))
    return max(floor, spread)


def _compared_positions(
    values: torch.Tensor, expected: torch.Tensor, fixed: torch.Tensor | None
) -> torch.Tensor | None:
    """The positions finite in both and not ``fixed`` (all finite ones where every one is
    fixed), or None where a value is not finite and fp32's differs there (an overflow fp32
    does not have: infinite error)."""
    finite = torch.isfinite(values) & torch.isfinite(expected)
    same = (values == expected) | (torch.isnan(values) & torch.isnan(expected))
    if bool((~finite & ~same).any()):
        return None
    # (found by a hunt: with a -inf mask beside fixed values the test read "not all fixed",
    # left every finite position out and a trial 10x off read 0.0)
    varying = finite if fixed is None else finite & ~fixed
    return varying if bool(varying.any()) else finite


def _sampled_error(
    values: torch.Tensor, expected: torch.Tensor, fixed: torch.Tensor | None = None
) -> float:
    """Relative L2 error of ``values`` against ``expected`` over the positions finite in both.
    A non-finite value where fp32's is the same (masked logits at -inf, NaN padding) is not a
    difference; one where fp32's differs (an overflow fp32 does not have) is infinite error.
    ``fixed`` marks positions that do not depend on the weights (see ``_fixed_positions``):
    they are left out, as long as something else is left to compare. Norms are taken in
    float64: fp32's overflowed on fill values near its largest float."""
    compared = _compared_positions(values, expected, fixed)
    if compared is None:
        return math.inf
    expected, values = expected[compared].double(), values[compared].double()
    denominator = float(expected.norm()) or 1.0
    return float((values - expected).norm()) / denominator


MIN_ROW_SAMPLES = 8
"""Sampled values a row needs for the row-centred comparison where rows are sampled, not read
whole: a row's constant leaves any mean of its samples exactly, but a mean of n samples of a
row of thousands removes 1/n of a real difference's square with it (n = 8: the centred error
reads at least 93.5% of a difference that is no constant), and of one sample all of it. A
row read whole is centred by its own mean, which is what a softmax ignores (two values of
it at least)."""


def _row_centered_error(
    output: OutputSummary, expected: OutputSummary, fixed: torch.Tensor | None
) -> float | None:
    """Relative L2 error of the sampled values with each row's mean over the last dimension
    removed, the means taken over the row's sampled positions compared (fixed positions, mask
    fills, left out: averaged in, a fill of -1e9 swamped every row's mean and the centred
    error of outputs 100% apart read 0; a review). None without a class dimension, where a
    row holds fewer than ``MIN_ROW_SAMPLES`` such positions, or for a summary whose samples
    are not at today's positions. Rows read whole need two such positions."""
    shape = expected.shape
    if len(shape) < 2 or shape[-1] < 2:
        return None
    count = math.prod(shape)
    stride = sample_stride(count)
    positions = torch.arange(0, count, stride)
    values, reference = output.values, expected.values
    if not len(positions) == len(values) == len(reference):
        return None
    compared = _compared_positions(values, reference, fixed)
    if compared is None:
        return math.inf
    rows, inverse, counts = torch.unique(
        positions[compared] // shape[-1], return_inverse=True, return_counts=True
    )
    if not len(rows) or int(counts.min()) < (2 if stride == 1 else MIN_ROW_SAMPLES):
        return None
    centred = []
    for sampled in (values[compared].double(), reference[compared].double()):
        means = torch.zeros(len(rows), dtype=torch.float64).index_add_(0, inverse, sampled)
        centred.append(sampled - (means / counts)[inverse])
    denominator = float(centred[1].norm()) or 1.0
    return float((centred[0] - centred[1]).norm()) / denominator


def _fixed_positions(reference: OutputSummary, noise: OutputSummary | None) -> torch.Tensor | None:
    """Positions where the reference and the noise run (another batch order, so other trained
    weights) hold the very same non-zero value: a constant the model writes whatever its weights
    (a mask fill of -1e9 or ``finfo.min``, a passed-through input). Left in, such values swamp
    the norm and blind the check (at ``-2**30``), or overflow it (at fp32's ``finfo.min``, and
    at bf16's against fp32's: a NaN error that rejected amp_bf16; found by a hunt)."""
    if noise is None or noise.values.shape != reference.values.shape:
        return None
    return (reference.values == noise.values) & (reference.values != 0)


def _relative_error(
    outputs: list[OutputSummary | None],
    reference: list[OutputSummary | None],
    noise: list[OutputSummary | None] | None = None,
    centered: bool = False,
) -> tuple[float | None, float | None]:
    """Mean relative L2 error over the held-out outputs' sampled values (``centered``: less
    their rows' means, :func:`_row_centered_error`; None unless every output has them), and
    top-1 agreement; positions fixed in the reference and ``noise`` are left out of the
    error."""
    errors, agreements = [], []
    noise_outputs = noise if noise is not None else [None] * len(reference)
    for output, expected, other in zip(outputs, reference, noise_outputs, strict=False):
        if output is None or expected is None or output.shape != expected.shape:
            continue
        fixed = _fixed_positions(expected, other)
        if centered:
            error = _row_centered_error(output, expected, fixed)
            if error is None:  # no class dimension, or too few samples a row
                return None, None
            errors.append(error)
            continue
        errors.append(_sampled_error(output.values, expected.values, fixed))
        # (of one length, unless the reference was stored with every row's argmax, as before)
        if output.top1 is not None and expected.top1 is not None:
            if output.top1.shape != expected.top1.shape:
                continue
            agreements.append(float((output.top1 == expected.top1).float().mean()))
    error = statistics.fmean(errors) if errors else None
    agreement = statistics.fmean(agreements) if agreements else None
    return error, agreement


def _loss_checks(
    trial: TrialResult,
    reference: TrialResult,
    noise: TrialResult,
    limits: DriftThresholds,
    metrics: dict[str, float | None],
) -> list[str]:
    """Held-out and late training loss against the fp32 reference, in noise floors."""
    record, expected = trial.record, reference.record
    reasons = []
    floor = noise_floor(reference, noise, limits)
    metrics["noise_floor"] = floor
    allowed = limits.max_loss_gap_units * floor
    if record.heldout_losses and len(record.heldout_losses) == len(expected.heldout_losses):
        gap = statistics.fmean(
            b - a for a, b in zip(expected.heldout_losses, record.heldout_losses, strict=True)
        )
        metrics["heldout_loss_gap"] = gap
        if not math.isfinite(gap):  # the reference's are finite (checked when it ran)
            reasons.append(f"held-out loss is not finite ({gap}) where fp32's is")
        elif gap > allowed:
            reasons.append(
                f"held-out loss {gap:+.4g} worse than fp32, beyond {allowed:.3g} "
                f"({limits.max_loss_gap_units:g} x noise floor {floor:.3g})"
            )
    late = max(1, int(len(record.losses) * limits.late_fraction))
    if len(record.losses) == len(expected.losses) and record.losses:
        pairs = zip(expected.losses[-late:], record.losses[-late:], strict=True)
        late_gap = statistics.fmean(b - a for a, b in pairs)
        metrics["late_loss_gap"] = late_gap
        if not math.isfinite(late_gap):
            reasons.append(f"training loss over the last {late} steps is not finite ({late_gap})")
        elif late_gap > allowed:
            reasons.append(
                f"training loss over the last {late} steps {late_gap:+.4g} worse than "
                f"fp32 on the same batches, beyond {allowed:.3g}"
            )
    return reasons


def shown_forward_cost(drift: Mapping[str, float]) -> str:
    """A verdict's forward cost for a table: the share of the loss, or the cost in loss units
    where the loss floor, not the share, set the line it was judged by (a mean near 0: +89%
    for a cost of 1.8e-4 beside a loss with a negative constant misled; a hunt); "" without
    one."""
    cost, absolute = drift.get("forward_cost"), drift.get("forward_cost_absolute")
    if cost is None:  # no share: a mean of 0, or a read that was not finite
        finite = absolute is not None and math.isfinite(absolute)
        return f"{absolute:+.3g} in loss units" if finite else ""
    line, floor = drift.get("forward_cost_line"), drift.get("loss_floor_units")
    if line is None or floor is None:  # stored before 2026-11-29: its floor, 1e-4 in loss units
        line, floor = (abs(absolute / cost) * 0.01, 1e-4) if absolute is not None else (0, 0)
    if absolute is not None and floor and line <= floor:
        return f"{absolute:+.3g} in loss units"
    return f"{cost:+.2%}" if round(cost, 4) else "+0.00%"  # not "-0.00%"


def _forward_cost_check(
    record: TrialRecord,
    reference: TrialRecord,
    floor: float,
    limits: DriftThresholds,
    metrics: dict[str, float | None],
) -> list[str]:
    """The mode's forward pass against the same weights read in fp32: a cost without seed
    noise, which training longer does not remove (see max_forward_cost), as a share of the
    loss (of how far it fell, for a loss that goes negative: :func:`loss_scale`). Near a loss
    of zero the loss checks' ``floor`` in loss units applies."""
    read, own = record.heldout_losses_fp32_read, record.heldout_losses
    if not read or len(read) != len(own):
        return []
    read_mean, own_mean = statistics.fmean(read), statistics.fmean(own)
    difference = own_mean - read_mean
    scale = loss_scale(reference, read_mean, limits.late_fraction)
    share_line = limits.max_forward_cost * scale
    allowed = max(share_line, floor)
    cost = f"{difference:+.4g}"
    metrics["forward_cost_absolute"] = difference
    metrics["forward_cost_line"] = allowed
    if scale:
        metrics["forward_cost"] = difference / scale
        if share_line > floor:
            cost = f"{difference / scale:+.2%} ({cost})"
    if math.isfinite(difference) and difference <= allowed:
        return []
    if not math.isfinite(difference):  # an fp32 read of +inf gave -inf: it passed (a hunt)
        metrics["forward_cost"] = None
        return [
            f"held-out loss read by the mode's forward ({own_mean:.5g}) or by fp32 from the same "
            f"trained weights ({read_mean:.5g}) is not finite"
        ]
    of = "" if scale == abs(read_mean) else f" of how far the loss fell ({scale:.4g})"
    return [
        f"the mode's forward pass alone costs {cost} held-out loss ({own_mean:.5g} vs "
        f"{read_mean:.5g} for the same trained weights read in fp32), beyond {allowed:.3g} "
        f"({limits.max_forward_cost * 100:.3g}%{of}, at least the loss floor {floor:.3g}): a "
        "precision floor that training longer does not remove"
    ]


def _output_check(
    trial: TrialResult,
    reference: TrialResult,
    noise: TrialResult,
    paired: TrialResult | None,
    limits: DriftThresholds,
    metrics: dict[str, float | None],
) -> list[str]:
    """Held-out outputs against the reference's, in units of the paired fp32 run's difference:
    raw, and, where the reference found the loss ignores a constant added to a row of its
    prediction (``TrialRecord.row_constants_ignored``), with each row's mean over the class
    dimension removed; rejected only when both differ beyond their bars. A constant added to a
    row of logits changes no softmax, log-softmax or CRF score, no loss gives it a gradient,
    and bf16 rounding noise walks along it where a nudged fp32 run does not: on a BiLSTM-CRF
    tagger bf16_sr's emissions were 31.3% apart (paired 0.04%), 94% of it such a constant, 5.5%
    without it, and its 2000-step runs ended with fp32's tag error (found by a hunt). Forgiven
    for any output, an ordinal (CORAL) head's row mean, all of its input-dependent part, went
    unjudged, and pure bf16 passed where its long runs ended 57% worse (a hunt)."""
    expected, other, own = reference.heldout_outputs, noise.heldout_outputs, trial.heldout_outputs
    error, agreement = _relative_error(own, expected, other)
    ignored = reference.record.row_constants_ignored
    centered = _relative_error(own, expected, other, centered=True)[0] if ignored else None
    noise_error = noise_centered = 0.0  # no paired run: the floors alone
    if paired is not None:
        noise_error = _relative_error(paired.heldout_outputs, expected, other)[0] or 0.0
        if ignored:
            found = _relative_error(paired.heldout_outputs, expected, other, centered=True)[0]
            noise_centered = found or 0.0
    metrics["output_error"], metrics["top1_agreement"] = error, agreement
    metrics["output_error_noise"] = noise_error if error is not None else None
    metrics["output_error_centered"] = centered
    metrics["output_error_centered_noise"] = noise_centered if centered is not None else None
    if error is None:
        return []
    allowed = _output_bar(limits, noise_error)
    if error <= allowed or (
        centered is not None and centered <= _output_bar(limits, noise_centered)
    ):
        return []
    if math.isinf(error):
        return ["held-out outputs are not finite where fp32's are (or differ in sign of infinity)"]
    shown, limit = _apart(error, allowed)
    without = "" if centered is None else f"; {centered:.1%} with each row's mean removed"
    return [f"held-out outputs differ from fp32 by {shown} (relative L2{without}), beyond {limit}"]


def _output_bar(limits: DriftThresholds, noise: float) -> float:
    return max(limits.output_error_floor, limits.max_output_error_units * noise)


def _row_constant_note(metrics: dict[str, float | None], limits: DriftThresholds) -> list[str]:
    """A note where the outputs differ beyond their bar only by a constant per row."""
    error, noise = metrics.get("output_error"), metrics.get("output_error_noise") or 0.0
    centered = metrics.get("output_error_centered")
    if error is None or centered is None or error <= _output_bar(limits, noise):
        return []
    centered_noise = metrics.get("output_error_centered_noise") or 0.0
    if math.isinf(error) or centered > _output_bar(limits, centered_noise):
        return []
    shown, bar = _apart(error, _output_bar(limits, noise))
    return [
        f"held-out outputs differ from fp32 by {shown} (beyond {bar}), {centered:.1%} with each "
        "row's mean over the last dimension removed: judged by the latter (your loss ignores a "
        "constant added to a row of its prediction, as softmax, log-softmax and CRF scores do)"
    ]


def _apart(value: float, limit: float) -> tuple[str, str]:
    """``value`` and the ``limit`` it passed as percents, with as many decimals as it takes
    for them to read apart (found by a hunt: "by 10.0%, beyond 10.0%" for 10.04% over 10%)."""
    for decimals in range(1, 5):
        shown, bar = f"{value:.{decimals}%}", f"{limit:.{decimals}%}"
        if shown != bar:
            return shown, bar
    return f"{value:.4%}", f"{limit:.4%}"


def _eval_check(
    record: TrialRecord,
    reference: TrialRecord,
    noise: TrialRecord,
    limits: DriftThresholds,
    metrics: dict[str, float | None],
) -> list[str]:
    """``eval_fn``'s score against the reference's, in units of the noise run's difference."""
    if record.eval_score is None or reference.eval_score is None:
        return []
    if not math.isfinite(record.eval_score):
        return [f"eval_fn returned {record.eval_score} (fp32: {reference.eval_score:.4g})"]
    gap = record.eval_score - reference.eval_score
    metrics["eval_gap"] = gap
    # a noise score of 0.0 is a score, not a missing one
    noise_gap = 0.0 if noise.eval_score is None else abs(noise.eval_score - reference.eval_score)
    allowed = max(
        limits.eval_floor_relative * abs(reference.eval_score),
        limits.max_eval_gap_units * noise_gap,
    )
    if gap <= allowed:
        return []
    return [
        f"eval_fn {record.eval_score:.4g} vs fp32 {reference.eval_score:.4g}"
        f" (worse by {gap:.3g}, beyond {allowed:.3g})"
    ]


def judge(
    trial: TrialResult,
    reference: TrialResult,
    noise: TrialResult,
    thresholds: DriftThresholds | None = None,
    *,
    paired: TrialResult | None = None,
    nudged: TrialResult | None = None,
) -> DriftVerdict:
    """Every reason ``trial`` drifts from the fp32 ``reference``.

    ``noise`` is the second fp32 run (another seed and batch order) that sets the loss and
    ``eval_fn`` noise floors; ``paired`` the fp32 run on the same batch order with other
    random draws, or from nudged weights (see ``Fp32Runs.paired``), that sets the movement and
    output noise (None: the floors alone); ``nudged``, for a model with random draws, the fp32
    run with the reference's draws from nudged weights, which sets them for a trial that drew
    the reference's draws (None: such a trial is judged against the floors alone).
    """
    limits = thresholds or DriftThresholds()
    record = trial.record
    if record.failure is not None:
        reason = record.failure.reason()
        if record.spec.mode == "amp_fp16" and record.failure.kind == "non_finite_loss":
            # fp32's reference stayed finite on the same batches: fp16's range (found by a
            # hunt: "loss is nan at step 0" alone, with no cause and no way out)
            reason += (
                " (fp32 stayed finite: likely an fp16 overflow, a value above 65504 in the "
                "forward or the loss; keep the module that makes it in fp32 (keep_fp32), or "
                "use amp_bf16)"
            )
        elif record.spec.mode in PURE_BF16_MODES and record.failure.kind.startswith("non_finite"):
            # an op with no finite bf16 result where fp32 has one (torch's bf16 matrix_exp
            # under an orthogonal parametrization): "loss is nan at step 1" alone (a hunt)
            reason += (
                " (fp32 stayed finite on the same batches: an op of the model has no finite "
                "result in bf16, e.g. matrix_exp under an orthogonal parametrization; keep the "
                "module that computes it in fp32 (keep_fp32), or use amp_bf16)"
            )
        return DriftVerdict(accepted=False, reasons=(reason,), metrics=DriftMetrics())
    metrics: dict[str, float | None] = {}
    paired, shared_note = _paired_for(trial, reference, paired, nudged)
    reasons = _loss_checks(trial, reference, noise, limits, metrics)
    metrics["loss_floor_units"] = in_units = loss_floor_units(reference.record, limits)
    forward_reasons = _forward_cost_check(record, reference.record, in_units, limits, metrics)
    movement_reasons, movement_notes = movement_checks(
        trial,
        reference,
        paired,
        limits,
        metrics,
        _paired_label(reference, paired, nudged),
        forward_too_costly=bool(forward_reasons),
    )
    reasons += movement_reasons
    reasons += state_rule_reasons(record, limits, metrics)
    reasons += outside_state_reasons(trial, reference)
    reasons += forward_reasons
    output_reasons = _output_check(trial, reference, noise, paired, limits, metrics)
    skip_notes = _parted_by_skips(record, output_reasons, metrics)
    reasons += [] if skip_notes else output_reasons
    if record.spec.mode == "amp_fp16":
        reasons += fp16_risks(record, reference, limits, metrics)
    reasons += _eval_check(record, reference.record, noise.record, limits, metrics)
    return DriftVerdict(
        accepted=not reasons,
        reasons=tuple(reasons),
        metrics=DriftMetrics(**metrics),
        notes=(
            *_checks_not_run(trial, reference, metrics["output_error"] is not None),
            *movement_notes,
            *shared_note,
            *decay_note(trial),
            *skip_notes,
            *_row_constant_note(metrics, limits),
        ),
    )


def _parted_by_skips(
    record: TrialRecord, output_reasons: list[str], metrics: dict[str, float | None]
) -> tuple[str, ...]:
    """A note in place of the output check's reject, for an amp_fp16 trial whose loss scaler
    skipped steps after settling: a skipped step drops an update fp32 applies, so the runs part
    by the skips, not by fp16's rounding, and the skip-rate check judges those. Found by a hunt:
    an MLP on heavy-tailed (Cauchy) targets skips outlier batches and was rejected for outputs
    apart (``python -m benchmarks.fp16_skipped_steps``: 2 of 200 steps skipped, outputs 19.9%
    apart, its paired fp32 run 0.06%); trained 2000 steps it ended at a test MSE of 60.09
    against fp32's 60.99 on average, at or below fp32's run of the same batch order at 5 of 6
    (the hunt's own data: 6 of 6). Outputs that are not finite still reject."""
    error = metrics.get("output_error")
    if (
        record.spec.mode != "amp_fp16"
        or not record.skipped_steps
        or not output_reasons
        or error is None
        or math.isinf(error)
    ):
        return ()
    return (
        f"{output_reasons[0]}, after the loss scaler skipped {record.skipped_steps} of "
        f"{record.steps_run} steps: a skipped step drops an update fp32 applies, so the runs "
        "part by the skips, not by fp16's rounding; the skip-rate check judges them, and "
        "outputs do not",
    )


EARLY_STEPS = 3
"""Training steps whose losses tell whether a trial drew the reference's random numbers: the
weights are still nearly the reference's, so only the draws and the precision differ."""

SHARED_DRAWS_RATIO = 0.25
"""A trial whose first losses are closer to the reference's than this share of the paired run's
drew the reference's random numbers (its dropout masks). Measured on the regression task with
dropout 0.1-0.5 at lr 1e-4 to 1e-2 (tests/test_drift.py's dropout runs): every mode sharing the
masks (amp_bf16, amp_fp16, bf16_pure, bf16_sr, bf16_kahan, bf16_sr_kahan) sat at 0.001-0.108 of
the paired run's difference, and an fp32 run with other masks at 0.46-1.07; 0.25 sits between,
over 2x from each."""


def _paired_for(
    trial: TrialResult,
    reference: TrialResult,
    paired: TrialResult | None,
    nudged: TrialResult | None,
) -> tuple[TrialResult | None, tuple[str, ...]]:
    """The run whose differences set the movement and output bars: the paired run (other random
    draws), unless the trial drew the reference's own (autoprec gives every trial the
    reference's seed, and stochastic rounding its own generator). Such a trial is as
    deterministic against the reference as a model without draws, and the paired run's
    difference, mostly other dropout masks, let through a bf16_pure that lost a third of its
    updates and moved the outputs 14% (found by a hunt): it is judged against the ``nudged``
    run, which shares those draws too (the floors alone when there is none; a chaotic dropout
    model's amp_bf16 was rejected by them, its outputs 14.6% apart, see
    benchmarks/chaos_floor.py). A mode whose kernels draw otherwise (fused attention's dropout)
    keeps the paired bars. A model without draws keeps its paired run, the nudged one,
    whatever the trial: it has no draws to share (found by a hunt: a trial whose first losses
    were fp32's lost the nudged bars there, with a note about draws the model never made)."""
    if paired is None or not reference.record.draws_random:
        return paired, ()
    ours = _early_difference(trial, reference)
    theirs = _early_difference(paired, reference)
    if ours is None or theirs is None or theirs == 0 or ours >= SHARED_DRAWS_RATIO * theirs:
        return paired, ()
    judged = (
        "against an fp32 run with the same draws from weights nudged 2^-12"
        if nudged is not None
        else "as for a model without random draws"
    )
    return nudged, (
        f"the trial drew the reference's random numbers (its first {EARLY_STEPS} losses are "
        f"under {SHARED_DRAWS_RATIO:.0%} as far from fp32's as a run with other draws): weight "
        f"movement and outputs judged {judged}",
    )


def _paired_label(
    reference: TrialResult, paired: TrialResult | None, nudged: TrialResult | None
) -> str:
    """How a reason names the run that set the movement bar: the paired run of a model with
    random draws draws others; the nudged run (a model's without draws is its paired run)
    starts from weights 2^-12 apart with the reference's draws."""
    if reference.record.draws_random and paired is not None and paired is not nudged:
        return "a second fp32 run with other random draws"
    return "an fp32 run from weights nudged 2^-12"


def _early_difference(run: TrialResult, reference: TrialResult) -> float | None:
    ours, theirs = run.record.losses[:EARLY_STEPS], reference.record.losses[:EARLY_STEPS]
    if len(ours) < EARLY_STEPS or len(theirs) < EARLY_STEPS:
        return None
    difference = statistics.fmean(abs(b - a) for a, b in zip(theirs, ours, strict=True))
    return difference if math.isfinite(difference) else None


def _checks_not_run(
    trial: TrialResult, reference: TrialResult, outputs_compared: bool
) -> tuple[str, ...]:
    if not reference.record.heldout_losses:
        return (
            "no held-out batches: held-out loss and outputs not compared (the late training "
            "loss stands in), and neither the forward cost nor the fp16 activation range is "
            "read (both read the held-out pass); give the loader two or more batches",
        )
    notes = []
    if not outputs_compared:
        notes.append(
            "held-out outputs not compared: no prediction reached autoprec (a floating "
            "tensor with a batch dimension: the output, its .logits, or the first among its "
            "items besides the loss; the model returns only a loss or integer, bool or complex "
            "tensors, or train_step called it more than once a batch); losses, movement and "
            "eval_fn are judged"
        )
    record = trial.record
    if record.spec.mode != "fp32" and record.heldout_losses and not record.heldout_losses_fp32_read:
        why = record.fp32_read_failure or (
            "its trained weights did not load into your model (the mode renamed parameters)"
        )
        notes.append(f"the mode's forward cost not measured: {why}")
    return tuple(notes)
