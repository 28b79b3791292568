"""The drift gate's fp16 checks: range headroom and the loss scaler's health.

Loss scaling protects gradients from underflow, not the forward pass from overflow: activations
above 65504 (fp16's largest finite value) overflow whatever the scaler does. Modules kept in
fp32 are not counted. The scaler's start-up skips are settled on the first batch before the trial
(``trial_loop.settle``, ``AmpFp16Mode.settle``), so a skip here is drift, not calibration.

Gradients are not judged by their size: the scaler scales them into fp16's range, below 1 where
they are large, and a gradient that overflows anyway is a skipped step, which the skip rule
judges. A loss weighted 1e6 to 1e8 (a sum over many pixels or tokens) had amp_fp16 rejected for
"gradients reach 2.54e+04" and a scale "collapsed" to 0.125, though it trains as fp32 does
(found by a hunt); the rule, checked on fp32's unscaled gradients, never moved a ground-truth
verdict.
"""

from __future__ import annotations

from autoprec.drift_thresholds import DriftThresholds
from autoprec.trial_records import TrialRecord, TrialResult

FP16_MAX = 65504.0


def fp16_risks(
    record: TrialRecord,
    reference: TrialResult,
    limits: DriftThresholds,
    metrics: dict[str, float | None],
) -> list[str]:
    """Activations or gradients near fp16's range, and an unhealthy loss scaler."""
    reasons = []
    limit = limits.fp16_headroom * FP16_MAX
    if record.spec.keep_fp32:  # the kept modules run in fp32: only the trial saw the fp16 parts
        activation = record.max_abs_activation or 0.0
    else:
        activation = max(
            reference.record.max_abs_activation or 0.0, record.max_abs_activation or 0.0
        )
    margin = f"within {1 / limits.fp16_headroom:.3g}x of fp16's max {FP16_MAX:.0f}"
    if activation > limit:
        reasons.append(
            f"fp16 overflow risk: activations reach {activation:.3g}, {margin} (activations "
            "grew up to 12x after a 200-step trial in autoprec's long-run benchmark; loss "
            "scaling cannot protect the forward pass: keep the module in fp32 or use amp_bf16)"
        )
    overflowed = [name or "the model" for name in _overflowed_leaves(record, reference)]
    if overflowed:
        shown = ", ".join(overflowed[:4]) + (
            f" and {len(overflowed) - 4} more" if len(overflowed) > 4 else ""
        )
        reasons.append(
            f"fp16 overflow: the output of {shown} reached infinity on the held-out batches "
            "where fp32's did not (a saturating op after it, like tanh, can hide it from the "
            "loss): keep the module in fp32 or use amp_bf16"
        )
    rate = record.skipped_steps / max(record.steps_run, 1)  # skips are counted over every step
    metrics["skipped_step_rate"] = rate
    if rate > limits.max_skipped_step_rate and record.skipped_steps > 1:
        reasons.append(
            f"loss scaler skipped {record.skipped_steps} of {record.steps_run} steps "
            f"({rate * 100:.3g}% > {limits.max_skipped_step_rate * 100:.3g}%)"
        )
    if _collapsed(record, limits):
        settled = record.settled_loss_scale
        since = "" if settled is None else f" during the trial (settled at {settled:g})"
        reasons.append(f"loss scale collapsed to {record.final_loss_scale:g}{since}")
    return reasons


def _collapsed(record: TrialRecord, limits: DriftThresholds) -> bool:
    """The loss scale fell below ``min_loss_scale`` during the trial, from where it settled.
    A scale that settled below it is the scaler doing its work: a loss weighted 1e7 settles at
    2**-7, trains as fp32 does (1000 steps, 3 seeds: within 0.1%, no skipped step) and was
    rejected as "collapsed" (found by a hunt)."""
    final, settled = record.final_loss_scale, record.settled_loss_scale
    if final is None or final >= limits.min_loss_scale:
        return False
    return settled is None or final < settled


def _overflowed_leaves(record: TrialRecord, reference: TrialResult) -> list[str]:
    """Leaves whose output held an infinity where fp32's did not (a mask filled with -inf is
    in both). Found by hunts: with ``keep_fp32`` only the trial's largest finite value was
    read, and an overflow to inf before a tanh passed; then counts were compared, and a kept
    mask's -inf, counted in the reference alone, cancelled the trial's overflow."""
    expected = set(reference.record.infinite_activation_leaves or ())
    return [name for name in record.infinite_activation_leaves or () if name not in expected]
