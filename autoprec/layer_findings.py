"""A model scan's findings: short sentences on what the layer mix means for precision choices
(convolution-heavy, raw-parameter matmuls, FP8 fit, 8-bit states, running statistics)."""

from __future__ import annotations

from autoprec._wording import first_names
from autoprec.layer_keep import RUNNING_STATE_REASON
from autoprec.layer_kinds import BNB_MIN_8BIT_SIZE, FP8_DIM_MULTIPLE
from autoprec.layer_mix import LayerMix


def fraction(part: int, whole: int) -> float:
    """``part / whole``, 0 for an empty whole."""
    return part / whole if whole else 0.0


def _percent(share: float) -> str:
    return f"{share * 100:.0f}%"


def findings(mix: LayerMix) -> list[str]:
    """What the layer mix means for the precision choices, one sentence each: what there is to
    train and to speed up, where the FLOPs are, which Linears FP8 can convert and whether it
    pays, what 8-bit states save, and the buffers training updates outside the optimizer."""
    if mix.parameters == 0:
        return ["the model has no parameters: there is nothing to train"]
    found = []
    if mix.trainable_parameters == 0:
        found.append(
            f"none of the model's {mix.parameters:,} parameters trains (requires_grad is off "
            "everywhere): there is nothing to train"
        )
    no_compute = _no_compute(mix)
    if no_compute is not None:
        return [*found, no_compute]
    if mix.forward_autocast is not None:
        found.append(
            f"the forward enters an autocast of its own ({mix.forward_autocast}): it sets the "
            "dtype of what runs under it in every mode's run, the fp32 reference's too, so "
            "tune and check refuse the model. Take that torch.autocast out of forward: each mode's "
            "plan.autocast() sets the precision"
        )
    return [
        *found,
        *_flop_share_findings(mix),
        *_linear_variant_findings(mix),
        *_fp8_fit_findings(mix),
        *_eight_bit_findings(mix),
        *_running_state_findings(mix),
    ]


def _no_compute(mix: LayerMix) -> str | None:
    """Why nothing more can be said: no forward pass ran, or it ran no matmul."""
    if mix.forward_flops is None:
        # with an error, the forward failed on the input given: asking for an example input
        # was wrong advice (found by a hunt)
        advice = (
            "fix the example input (its shape or dtype) so the model runs on it"
            if mix.forward_error
            else "give an example input"
        )
        reason = f" ({mix.forward_error})" if mix.forward_error else ""
        return f"no forward pass ran{reason}: FLOP shares are unknown; {advice}"
    if mix.forward_flops == 0:
        return (
            "the forward pass ran no matmuls or convolutions: low precision has "
            "little compute to speed up"
        )
    return None


def _flop_share_findings(mix: LayerMix) -> list[str]:
    """FLOPs in layers FP8 module swapping cannot reach (or need not: convolutions)."""
    found = []
    conv, raw = mix.kind("conv"), mix.kind("raw_param")
    recurrent, other = mix.kind("recurrent"), mix.kind("other")
    if (conv.flop_share or 0) >= 0.5:
        found.append(
            f"conv layers carry {_percent(conv.flop_share or 0)} of FLOPs: FP8 and 2:4 sparsity "
            "accelerate only Linear layers — little to gain from them; AMP bf16/fp16 does speed "
            "up convolutions"
        )
    if (raw.flop_share or 0) >= 0.05:
        found.append(
            f"{_percent(raw.flop_share or 0)} of FLOPs are matmuls on raw nn.Parameter tensors "
            f"({first_names(mix.raw_param_matmuls)}): FP8 module swapping cannot reach them"
        )
    if (recurrent.flop_share or 0) >= 0.05:
        found.append(
            f"{_percent(recurrent.flop_share or 0)} of FLOPs are in recurrent layers (nn.LSTM, "
            "nn.GRU, nn.RNN): FP8 module swapping converts nn.Linear only and cannot reach them"
        )
    if (other.flop_share or 0) >= 0.2:
        found.append(
            f"{_percent(other.flop_share or 0)} of FLOPs are matmuls between activations "
            "(e.g. attention scores): autocast lowers their precision, FP8 Linear swaps do not"
        )
    return found


def _linear_variant_findings(mix: LayerMix) -> list[str]:
    """Linears of other classes: Hugging Face's Conv1D, bitsandbytes' 4-bit layers."""
    found = []
    flops = mix.forward_flops or 0
    conv1d = [linear for linear in mix.linears if linear.hf_conv1d]
    if conv1d:
        conv1d_share = fraction(sum(linear.flops or 0 for linear in conv1d), flops)
        found.append(
            f"{len(conv1d)} Hugging Face Conv1D layers ({first_names([c.fqn for c in conv1d])}) "
            f"carry {_percent(conv1d_share)} "
            "of FLOPs: they are Linears with transposed (in, out) weights, counted as Linear; "
            "torchao's and Transformer Engine's FP8 conversions replace nn.Linear modules only, "
            "so FP8 leaves them in higher precision (AMP and pure bf16 do cover them)"
        )
    quantized = [linear for linear in mix.linears if linear.bnb_4bit]
    if quantized:
        found.append(
            f"{len(quantized)} bitsandbytes 4-bit Linear layers "
            f"({first_names([q.fqn for q in quantized])}) "
            f"carry {_percent(fraction(sum(q.flops or 0 for q in quantized), flops))} "
            "of FLOPs: their weights stay 4-bit in every mode and FP8 does not convert them"
        )
    return found


def _fp8_fit_findings(mix: LayerMix) -> list[str]:
    """How many Linears fit FP8 kernels, and whether any is large enough to pay."""
    if not mix.linears:
        conv, linear = mix.kind("conv"), mix.kind("linear")
        if (linear.flop_share or 0) == 0 and (conv.flop_share or 0) < 0.5:
            return ["the model has no nn.Linear layers: FP8 module swapping has nothing to do"]
        return []
    compatible = mix.fp8_compatible_linears
    share = mix.fp8_eligible_flop_share or 0.0
    found = [
        f"{len(compatible)} of {len(mix.linears)} Linear layers fit FP8 kernels (plain "
        f"nn.Linear, both dims divisible by {FP8_DIM_MULTIPLE}), carrying {_percent(share)} "
        "of FLOPs"
    ]
    if compatible and not any(linear.fp8_worthwhile for linear in compatible):
        largest = max(compatible, key=lambda linear: linear.in_features * linear.out_features)
        found.append(
            f"all FP8-compatible Linears are small (largest {largest.in_features}x"
            f"{largest.out_features}): FP8 casting overhead likely exceeds the gain"
        )
    return found


def _eight_bit_findings(mix: LayerMix) -> list[str]:
    """Whether 8-bit optimizer states save much: bitsandbytes keeps small tensors in 32 bit."""
    large_share = fraction(mix.parameters_in_large_tensors, mix.trainable_parameters)
    if mix.trainable_parameters and large_share < 0.5:
        return [
            f"only {_percent(large_share)} of trainable parameters sit in tensors of >= "
            f"{BNB_MIN_8BIT_SIZE} "
            "elements: 8-bit optimizer states save little (bitsandbytes keeps small tensors in "
            "32 bit)"
        ]
    return []


def _running_state_findings(mix: LayerMix) -> list[str]:
    if mix.running_buffers_error is not None:
        return [
            f"a training-mode forward failed ({mix.running_buffers_error}): which buffers "
            "training updates is unknown, so pure bf16 keeps only norms and embeddings in fp32"
        ]
    kept = mix.kept_for(RUNNING_STATE_REASON)
    own = [fqn for fqn in mix.running_buffers if "." not in fqn]
    findings: list[str] = []
    if kept:
        findings.append(
            f"training updates buffers of {first_names(kept)}"
            " outside the optimizer (running statistics): pure bf16 keeps those modules in fp32, "
            "since in bf16 their updates round to nearest whatever the optimizer does"
        )
    if own:
        findings.append(
            f"training updates the model's own buffers ({', '.join(own)}): pure bf16 casts them "
            "to bf16, where small updates round away; hold them in a submodule so it can be "
            "kept in fp32"
        )
    return findings
