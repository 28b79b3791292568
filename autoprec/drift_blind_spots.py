"""What the drift gate's accept does not cover: the known blind spots of a short trial.

An accept means the mode did not drift from fp32 over the trial's steps. Some harm only shows
later; where we measured such a case, or the literature reports one, the accept says so, with
the figure, instead of letting "safe" read as "safe for any run length". Each text names where
its figure comes from (our benchmarks, docs/ground-truth.md, a paper by arXiv
number).
"""

from __future__ import annotations

from autoprec.modes import MODE_CLASSES
from autoprec.modes.pure_bf16 import Bf16PureMode
from autoprec.specs import ModeSpec

FP8_CONVERGED_COST = (
    "FP8's cost at a converged loss is a floor of its forward pass that a trial from the "
    "start of a run does not see: in autoprec's long-run benchmark (benchmarks/ground_truth.py), "
    "on a cosine-schedule regression, emulated FP8 passed this gate after 200, 1000 and 2000 "
    "trial steps and ended its 2000-step run +2.1% on test loss (3 seeds, each above all 8 "
    "fp32 seeds; `python -m benchmarks.fp8_cost_split`). Checked from a checkpoint at 90% of the "
    "run, the gate rejected it: its forward alone cost +1.33% there "
    "(`python -m benchmarks.late_checkpoint`). Run the check on a model loaded from a "
    "checkpoint in the last tenth of your run, at the lr it ends at. FP8 failures in LLM "
    "training have taken ~200B tokens to show (arXiv 2409.12517)"
)
"""Measured on our CPU machines (docs/ground-truth.md, "The false accept")."""

BF16_LATE_ROUNDING = (
    "harm that grows after the trial: in autoprec's long-run benchmark, on a conv net "
    "(AdamW, constant lr 1e-3), pure bf16's 200-step trial moved 98% as far as fp32's, with "
    "held-out loss within noise and outputs 6.1% apart; its runs ended +58.8% on test loss "
    "after 2000 steps (mean of 3 seeds, 2.1 fp32 seed deviations) and +454% after 10000. "
    "Only the optimizer-state rule rejected it (`python -m benchmarks.threshold_sweep`); with "
    "beta2 0.95, where that rule does not apply, the gate accepted it and its runs ended "
    "+105% (`python -m benchmarks.state_rule_beta2`). With 8-bit states the trial alone "
    "passed it on the same conv net (99.3% of fp32's movement) and its runs ended +58.3% (8 "
    "seeds against 16 fp32 seeds, `python -m benchmarks.truth_power`), and on a recommender "
    "(embeddings, Adam 1e-3) +12.5%: fp32 left a loss plateau at step ~1000 that pure bf16 "
    "had not left by 2000, and a check from 90% of the run passed it too; so the rule now "
    "judges pure bf16 with 8-bit states as well. nanoGPT's recipe (beta2 0.95), where the "
    "gate accepted both pure-bf16 modes and both ended fine, is the one long-run task under "
    "its line. Prefer bf16_sr, "
    "bf16_sr_kahan or bf16_kahan, which passed and ended within the fp32 seeds' spread on "
    "every task, or for 8-bit states' memory bf16_sr+8bit-optim, which did on all 13 it ran on"
)
"""Measured on our CPU machines (docs/ground-truth.md: "Each threshold against the truth", "The
state rule over a longer horizon", "Held-out tasks"). An accepted bf16_pure got past the state rule
(beta2 <= 0.99609375, an optimizer other than Adam, or the rule lifted), so its trial, not the rule,
spoke for it."""

FP16_LATE_GROWTH = (
    "fp16's range was checked on the trial's activations and gradients: the check leaves 16x "
    "for growth after the trial, and in autoprec's long-run benchmark (`python -m "
    "benchmarks.fp16_headroom`) activations grew up to 11.9x by 10 times the trial's length "
    "and 20.4x by 50 times (a classifier's logits). Activations that pass 65504 later overflow "
    "the forward pass, where loss scaling cannot help; outliers that grow with training "
    "preceded the low-precision failures of arXiv 2409.12517"
)
"""The growth measured on our CPU machines (docs/ground-truth.md, "The fp16 headroom"); the late
failures from the literature (arXiv 2409.12517; early-warning signals in arXiv 2505.20524 and
2304.13013)."""


BF16_WEIGHT_AVERAGE = (
    "an average of the weights (EMA) you keep, if any, which no trial runs: made from the "
    "model after apply() it is bf16 like the weights, and with decay 0.999 each update "
    "moves it by 0.1%, below half a bf16 ulp, so it stops moving. Measured in bf16_sr (3000 "
    "steps, 3 seeds): the average's held-out loss 0.405 in bf16 against 0.0157 in fp32 "
    "(`python -m benchmarks.ema_rounding`). Keep it in fp32: AveragedModel(model, "
    "avg_fn=get_ema_avg_fn(0.999)).float()"
)
"""Measured on our CPU machines (docs/runtime.md, "Weight averages under bf16 weights"). Every mode
with bf16 weights: the average is the user's, made after apply()."""


BF16_CONVERGED_COST = (
    "the cost of computing in bf16 at the loss your run reaches: pure bf16 runs every op in "
    "bf16 (autocast keeps cumsum, exp, softmax and norms in fp32), and that cost can be a "
    "floor that shows only once the loss has fallen, as FP8's does. On a selective-scan LM "
    "(`python -m benchmarks.bf16_converged_cost`) fp32's weights read in pure bf16 cost "
    "+0.00% at step 0 and +1.84% at step 1500, and nothing with the scan modules kept fp32; "
    "checked from the trained weights, bf16_sr (+1.43%) and bf16_kahan (+1.50%) were "
    "rejected for it. Their own 1500-step runs ended within fp32's seed spread there. Run the "
    "check on a model loaded from a checkpoint late in your run, at the lr it ends at, or keep "
    "such modules in fp32 (keep_fp32)"
)
"""Measured on our CPU machines (found by a hunt, 2026-11-29; the benchmark's docstring). Every
mode with bf16 weights computes in bf16; FP8 has its own note, AMP runs those ops in fp32."""


def blind_spots(spec: ModeSpec) -> tuple[str, ...]:
    """What an accept of ``spec`` by a short trial does not show, with its figures.

    Empty for modes whose accepts the ground truth found right on every task and that leave
    the weights fp32 (AMP bf16, 8-bit states with fp32 or AMP weights); the stochastically
    rounded bf16 modes and bf16_kahan (since its second moment is fp32), right on every task
    too, carry the notes every mode with bf16 weights does: the cost of computing in bf16 at a
    converged loss, and the weight average.
    """
    found = []
    if spec.mode in ("fp8_torchao", "fp8_te"):
        found.append(FP8_CONVERGED_COST)
    if spec.mode == "bf16_pure":
        found.append(BF16_LATE_ROUNDING)
    if issubclass(MODE_CLASSES[spec.mode], Bf16PureMode):  # every mode with bf16 weights
        found.extend((BF16_CONVERGED_COST, BF16_WEIGHT_AVERAGE))
    if spec.mode == "amp_fp16":
        found.append(FP16_LATE_GROWTH)
    return tuple(found)
