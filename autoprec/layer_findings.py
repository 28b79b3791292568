"""A model scan's findings: short sentences on what the layer mix means for precision choices
(convolution-heavy, raw-parameter matmuls, FP8 fit, 8-bit states, running statistics)."""

from __future__ import annotations

from autoprec.layer_keep import RUNNING_STATE_REASON
from autoprec.layer_kinds import BNB_MIN_8BIT_SIZE, FP8_DIM_MULTIPLE
from autoprec.layer_mix import LayerMix


def fraction(part: int, whole: int) -> float:
    """``part / whole``, 0 for an empty whole."""
    return part / whole if whole else 0.0


def _percent(share: float) -> str:
    return f"{share * 100:.0f}%"


def findings(mix: LayerMix) -> list[str]:
    findings: list[str] = []
    if mix.parameters == 0:
        findings.append("the model has no parameters: there is nothing to train")
        return findings
    if mix.trainable_parameters == 0:
        findings.append(
            f"none of the model's {mix.parameters:,} parameters trains (requires_grad is off "
            "everywhere): there is nothing to train"
        )
    if mix.forward_flops is None:
        # with an error, the forward failed on the input given: asking for an example input
        # was wrong advice (found by a hunt)
        advice = (
            "fix the example input (its shape or dtype) so the model runs on it"
            if mix.forward_error
            else "give an example input"
        )
        reason = f" ({mix.forward_error})" if mix.forward_error else ""
        findings.append(f"no forward pass ran{reason}: FLOP shares are unknown; {advice}")
        return findings
    if mix.forward_flops == 0:
        findings.append(
            "the forward pass ran no matmuls or convolutions: low precision has "
            "little compute to speed up"
        )
        return findings
    conv, linear = mix.kind("conv"), mix.kind("linear")
    raw, other = mix.kind("raw_param"), mix.kind("other")
    if (conv.flop_share or 0) >= 0.5:
        findings.append(
            f"conv layers carry {_percent(conv.flop_share or 0)} of FLOPs: FP8 and 2:4 sparsity "
            "accelerate only Linear layers — little to gain from them; AMP bf16/fp16 does speed "
            "up convolutions"
        )
    if (raw.flop_share or 0) >= 0.05:
        findings.append(
            f"{_percent(raw.flop_share or 0)} of FLOPs are matmuls on raw nn.Parameter tensors "
            f"({', '.join(mix.raw_param_matmuls[:3])}"
            f"{', ...' if len(mix.raw_param_matmuls) > 3 else ''}): FP8 module swapping cannot "
            "reach them"
        )
    recurrent = mix.kind("recurrent")
    if (recurrent.flop_share or 0) >= 0.05:
        findings.append(
            f"{_percent(recurrent.flop_share or 0)} of FLOPs are in recurrent layers (nn.LSTM, "
            "nn.GRU, nn.RNN): FP8 module swapping converts nn.Linear only and cannot reach them"
        )
    if (other.flop_share or 0) >= 0.2:
        findings.append(
            f"{_percent(other.flop_share or 0)} of FLOPs are matmuls between activations "
            "(e.g. attention scores): autocast lowers their precision, FP8 Linear swaps do not"
        )
    conv1d = [linear for linear in mix.linears if linear.hf_conv1d]
    if conv1d:
        conv1d_share = fraction(sum(linear.flops or 0 for linear in conv1d), mix.forward_flops)
        findings.append(
            f"{len(conv1d)} Hugging Face Conv1D layers ({', '.join(c.fqn for c in conv1d[:3])}"
            f"{', ...' if len(conv1d) > 3 else ''}) carry {_percent(conv1d_share)} "
            "of FLOPs: they are Linears with transposed (in, out) weights, counted as Linear; "
            "torchao's and Transformer Engine's FP8 conversions replace nn.Linear modules only, "
            "so FP8 leaves them in higher precision (AMP and pure bf16 do cover them)"
        )
    quantized = [linear for linear in mix.linears if linear.bnb_4bit]
    if quantized:
        findings.append(
            f"{len(quantized)} bitsandbytes 4-bit Linear layers "
            f"({', '.join(q.fqn for q in quantized[:3])}{', ...' if len(quantized) > 3 else ''}) "
            f"carry {_percent(fraction(sum(q.flops or 0 for q in quantized), mix.forward_flops))} "
            "of FLOPs: their weights stay 4-bit in every mode and FP8 does not convert them"
        )
    if mix.linears:
        compatible = mix.fp8_compatible_linears
        share = mix.fp8_eligible_flop_share or 0.0
        findings.append(
            f"{len(compatible)} of {len(mix.linears)} Linear layers fit FP8 kernels (plain "
            f"nn.Linear, both dims divisible by {FP8_DIM_MULTIPLE}), carrying {_percent(share)} "
            "of FLOPs"
        )
        if compatible and not any(linear.fp8_worthwhile for linear in compatible):
            largest = max(compatible, key=lambda linear: linear.in_features * linear.out_features)
            findings.append(
                f"all FP8-compatible Linears are small (largest {largest.in_features}x"
                f"{largest.out_features}): FP8 casting overhead likely exceeds the gain"
            )
    elif (linear.flop_share or 0) == 0 and (conv.flop_share or 0) < 0.5:
        findings.append("the model has no nn.Linear layers: FP8 module swapping has nothing to do")
    large_share = fraction(mix.parameters_in_large_tensors, mix.trainable_parameters)
    if mix.trainable_parameters and large_share < 0.5:
        findings.append(
            f"only {_percent(large_share)} of trainable parameters sit in tensors of >= "
            f"{BNB_MIN_8BIT_SIZE} "
            "elements: 8-bit optimizer states save little (bitsandbytes keeps small tensors in "
            "32 bit)"
        )
    findings.extend(_running_state_findings(mix))
    return findings


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
            f"training updates buffers of {', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}"
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
