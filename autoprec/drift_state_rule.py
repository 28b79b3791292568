"""The optimizer-state rule: pure bf16 under Adam with a beta2 above ``max_rounded_beta2``.

A rule, not a trial's measurement. Its harm builds after a short trial ends, so the trial
alone cannot see it (docs/ground-truth.md, "The state rule's premise", "Why no 200-step figure
replaces the rule"). It has two forms, one per way pure bf16 keeps Adam's second moment:

- **in bf16, rounded to nearest** (torch's Adam on bf16 weights): a step moves the moment by
  ``1 - beta2`` of itself, below half a bf16 ulp, so it can never decrease;
- **in 8-bit states** (bitsandbytes): the moment keeps its decay, because each block's scale
  is an fp32 absmax that decays with it. The weights are still bf16 rounded to nearest, and
  late in a run Adam's steps fall below half a bf16 ulp of them. On autoprec's long-run tasks
  with beta2 0.999 the 200-step trial accepted this mode on 4 and its runs hurt on 2 of those
  (docs/ground-truth.md, "Pure bf16 with 8-bit states under the rule").

Both forms share one line, ``DriftThresholds.max_rounded_beta2``, and so one way to lift them.
"""

from __future__ import annotations

from autoprec.drift_thresholds import DriftThresholds
from autoprec.trial_records import LowPrecisionMoment, TrialRecord

WAYS_OUT = (
    "bf16_kahan (its second moment in fp32), stochastically rounded states and weights "
    "(bf16_sr, bf16_sr_kahan)"
)
"""The modes that fixed pure bf16 on every long-run task (docs/ground-truth.md)."""

EIGHT_BIT_WAY_OUT = (
    "bf16_sr+8bit-optim (the same bf16 weights and 8-bit states, 4 bytes a parameter, with "
    "the weights rounded stochastically)"
)
"""The lean fix: ended within the fp32 seeds' spread and passed its trial on every long-run
task it trained on (docs/ground-truth.md, "bf16_sr with 8-bit states")."""

EIGHT_BIT_EVIDENCE = (
    "on autoprec's 12 long-run tasks with beta2 0.999, pure bf16 with 8-bit states ended worse "
    "than fp32 on 10 after 2000 steps (a conv net +58.3%, a recommender +12.5%, 8 seeds each) "
    "and within fp32's spread on 2; its 200-step trial passed it on 4 of the 12, and on 2 of "
    "those 4 its runs ended worse"
)
"""Measured on our CPU machines (benchmarks/ground_truth.py, benchmarks/truth_power.py; the
12 tasks: every ground-truth task trained by Adam with beta2 0.999. The 2 fine: the dropout
encoder -1.1%, the GRU +0.2%. The U-Net's samples, +7.7% on 3 seeds and fine by that truth's
line until 2026-11-28, end +9.7% at 16 fp32 seeds and 8 of the mode, against a line at +5.4%)."""


MOMENT_REASON = "optimizer state loses its updates"
WEIGHTS_REASON = "bf16 weights rounded to nearest under Adam"


def is_state_rule_reason(reason: str) -> bool:
    """Whether a verdict's reason is this rule's (either form), not a measurement's."""
    return reason.startswith((MOMENT_REASON, WEIGHTS_REASON))


def state_rule_reasons(
    record: TrialRecord, limits: DriftThresholds, metrics: dict[str, float | None]
) -> list[str]:
    """Why the rule rejects the trial's mode, or nothing (see the module docstring)."""
    moment = record.low_precision_moment
    if moment is not None and moment.rounding == "nearest":
        return _moment_reasons(moment, limits, metrics)
    beta2 = record.nearest_adam_beta2  # bf16_pure's alone: other modes' states are exempt
    if beta2 is None:
        return []
    metrics["rounded_beta2"] = beta2
    if beta2 <= limits.max_rounded_beta2:
        return []
    return [
        f"{WEIGHTS_REASON} with beta2={beta2:g}: the second moment "
        "is not in bf16 (8-bit states keep its decay), but late in a run Adam's steps fall "
        "below half a bf16 ulp of the weights and are lost (long runs end worse). "
        f"{EIGHT_BIT_WAY_OUT}, {WAYS_OUT} or beta2 <= "
        f"{limits.max_rounded_beta2:.8g} avoid it. A rule, not this trial's measurement: "
        f"{EIGHT_BIT_EVIDENCE}; {_lift(beta2)}"
    ]


def _moment_reasons(
    moment: LowPrecisionMoment, limits: DriftThresholds, metrics: dict[str, float | None]
) -> list[str]:
    metrics["rounded_beta2"] = moment.beta2
    if moment.beta2 <= limits.max_rounded_beta2:
        return []
    return [
        f"{MOMENT_REASON}: Adam's second moment is kept in "
        f"{moment.dtype} rounded to nearest, and with beta2={moment.beta2:g} a step "
        f"changes it by {1 - moment.beta2:.2g} of itself, below half a {moment.dtype} ulp: "
        f"it can never decrease (long runs end worse). {WAYS_OUT} or beta2 <= "
        f"{limits.max_rounded_beta2:.8g} avoid it. A rule, not this trial's measurement: on "
        "autoprec's 8 long-run tasks with beta2 0.999, Kahan-compensated bf16 weights ended "
        "2-17% worse after 2000 steps on 3 with this moment in bf16, and fine on all 8 with it "
        f"in fp32; {_lift(moment.beta2)}"
    ]


def _lift(beta2: float) -> str:
    """How to judge by the trial alone: a ``max_rounded_beta2`` that lets ``beta2`` through,
    0.9995 for Adam's usual 0.999; for a higher beta2 (0.9999) that value still rejected it
    (found by a hunt). In words for both interfaces (the CLI once printed Python)."""
    line = "0.9995" if beta2 <= 0.9995 else f"{beta2:.10g}"
    return (
        f"to judge by the trial alone set max_rounded_beta2={line} (thresholds= in Python, "
        "--threshold on the command line)"
    )
