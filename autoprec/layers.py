"""Model scan: parameters and forward FLOPs by layer kind, FP8 fit, fp32 keep-list defaults.

One forward pass under a dispatch mode attributes every matmul, convolution and attention FLOP
(``torch.utils.flop_counter`` formulas) to the innermost module kind it ran in. Matmuls outside
any Linear/Conv module whose operand is a parameter held directly by a custom module
(``x @ self.W``) are counted as ``raw_param``: FP8 module swapping cannot reach them. Matmuls
between activations (attention scores) are ``other``.

The scan runs in eval mode under ``torch.no_grad()`` and restores every module's training
flag, so the model's parameters, buffers (BatchNorm statistics), gradients and modes are left as
they were (bitsandbytes' 4-bit Linears stay in training mode: in eval mode they repack their
weights for CPU inference, and the model then fails to train). It runs wherever the model
lives: CPU, or the meta device for models too big to materialise.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict
from torch import nn

from autoprec.layer_flops import FlopAttribution, run_forward, storage_key
from autoprec.layer_kinds import (
    BNB_MIN_8BIT_SIZE,
    FP8_DIM_MULTIPLE,
    LAYER_KINDS,
    LayerKind,
    fp8_linear_fits,
    fp8_worthwhile,
    is_bnb_4bit,
    is_hf_conv1d,
    linear_dims,
    module_kind,
)
from autoprec.running_state import running_buffers
from autoprec.weight_dtypes import non_fp32_weights

logger = logging.getLogger(__name__)


class KindShare(BaseModel):
    """Parameters and forward FLOPs of one layer kind."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: LayerKind
    parameters: int
    parameter_share: float
    flops: int | None
    flop_share: float | None


class LinearInfo(BaseModel):
    """One nn.Linear (or HF Conv1D) and its fit for FP8."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fqn: str
    in_features: int
    out_features: int
    flops: int | None
    fp8_compatible: bool
    """An nn.Linear with both dimensions divisible by 16 (what FP8 kernels take and FP8 module
    swaps convert)."""
    bnb_4bit: bool = False
    """A bitsandbytes 4-bit Linear (QLoRA's quantized base): FP8 conversions leave it as it
    is (not compatible), and it is not kept in fp32 for its dimensions."""
    hf_conv1d: bool = False
    """A Hugging Face Conv1D: counted as a Linear, but torchao's and Transformer Engine's FP8
    conversions replace nn.Linear modules only, so it stays out of FP8 (not compatible)."""
    fp8_worthwhile: bool
    """Compatible and big enough that FP8 is likely to gain (torchao's auto-filter rule)."""


class KeepFp32(BaseModel):
    """A module kept in full precision by default, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fqn: str
    reason: str


class LayerMix(BaseModel):
    """What a model is made of, as far as precision choices care."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_class: str
    parameters: int
    trainable_parameters: int
    parameters_in_large_tensors: int
    """Parameters in tensors of >= 4096 elements (those bitsandbytes keeps in 8 bit)."""
    by_kind: tuple[KindShare, ...]
    forward_flops: int | None
    """FLOPs of one forward pass on the example input (matmul, conv, attention); None if not run."""
    forward_error: str | None = None
    linears: tuple[LinearInfo, ...]
    fp8_eligible_flop_share: float | None
    """Share of forward FLOPs in FP8-compatible Linears; None when no forward pass ran."""
    raw_param_matmuls: tuple[str, ...]
    """Names of parameters used directly in matmuls (outside Linear/Conv modules)."""
    keep_fp32: tuple[KeepFp32, ...]
    findings: tuple[str, ...]
    complex_parameters: tuple[str, ...] = ()
    """Names of trainable complex parameters (a Fourier layer's spectral weights)."""
    sparse_gradient_modules: tuple[str, ...] = ()
    """Names of trainable ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` (their
    weights get sparse gradients)."""
    running_buffers: tuple[str, ...] = ()
    """Floating buffers a training-mode forward changes (BatchNorm statistics, a running
    normaliser, an EMA codebook): state outside the optimizer (``autoprec.running_state``)."""
    running_buffers_error: str | None = None
    """Why the training-mode forward that finds ``running_buffers`` failed, if it did."""

    def kind(self, kind: LayerKind) -> KindShare:
        """The share of one layer kind."""
        return next(share for share in self.by_kind if share.kind == kind)

    @property
    def fp8_compatible_linears(self) -> tuple[LinearInfo, ...]:
        return tuple(linear for linear in self.linears if linear.fp8_compatible)


def _parameter_kinds(model: nn.Module) -> dict[str, tuple[LayerKind, int]]:
    """fqn -> (kind of the owning module, element count), each shared parameter once."""
    seen: set[int] = set()
    result: dict[str, tuple[LayerKind, int]] = {}
    for module_fqn, module in model.named_modules():
        kind = module_kind(module) or "raw_param"
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            result[fqn] = (kind, parameter.numel())
    return result


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _run_scans(
    model: nn.Module, example_input: Any, attribution: FlopAttribution
) -> tuple[bool, str | None, tuple[str, ...], str | None]:
    """Run the forward scans on ``example_input`` (None: none): whether the FLOP-counting
    forward ran, its error, the running buffers a training-mode forward updates, that
    forward's error. A failed forward is reported (and logged), never raised."""
    if example_input is None:
        return False, None, (), None
    try:
        run_forward(model, example_input, attribution)
    except Exception as error:  # noqa: BLE001 - a failed forward is reported, not raised
        forward_error = f"{type(error).__name__}: {error}".splitlines()[0]
        logger.warning("forward pass for the model scan failed: %s", forward_error)
        return False, forward_error, (), None
    try:
        return True, None, running_buffers(model, example_input), None
    except Exception as error:  # noqa: BLE001 - reported as a finding, not raised
        running_error = f"{type(error).__name__}: {error}".splitlines()[0]
        logger.warning("training-mode forward for the model scan failed: %s", running_error)
        return True, None, (), running_error


def _kind_shares(
    parameter_kinds: dict[str, tuple[LayerKind, int]], attribution: FlopAttribution | None
) -> tuple[KindShare, ...]:
    """Parameters and forward FLOPs of each layer kind (FLOPs None when no forward ran)."""
    total_params = sum(count for _, count in parameter_kinds.values())
    forward_flops = sum(attribution.flops_by_kind.values()) if attribution else 0
    shares = []
    for kind in LAYER_KINDS:
        parameters = sum(count for k, count in parameter_kinds.values() if k == kind)
        flops = attribution.flops_by_kind[kind] if attribution else None
        shares.append(
            KindShare(
                kind=kind,
                parameters=parameters,
                parameter_share=_share(parameters, total_params),
                flops=flops,
                flop_share=None if flops is None else _share(flops, forward_flops),
            )
        )
    return tuple(shares)


def _linear_infos(model: nn.Module, attribution: FlopAttribution | None) -> tuple[LinearInfo, ...]:
    """Every Linear-like module: its dims, FLOPs (None when no forward ran), FP8 fit."""
    infos = []
    for fqn, module in model.named_modules():
        if module_kind(module) != "linear":
            continue
        dims = linear_dims(module)
        compatible = fp8_linear_fits(module)
        infos.append(
            LinearInfo(
                fqn=fqn,
                in_features=dims[0],
                out_features=dims[1],
                flops=attribution.flops_by_module.get(fqn, 0) if attribution else None,
                fp8_compatible=compatible,
                fp8_worthwhile=compatible and fp8_worthwhile(*dims),
                hf_conv1d=is_hf_conv1d(module),
                bnb_4bit=is_bnb_4bit(module),
            )
        )
    return tuple(infos)


def scan_model(model: nn.Module, example_input: Any = None) -> LayerMix:
    """Scan ``model``: parameter and FLOP shares by layer kind, FP8 fit, fp32 keep-list.

    Args:
        model: the model to scan. It is run once in eval mode without gradients; its state is
            left unchanged.
        example_input: a tensor, a tuple of positional arguments or a dict of keyword
            arguments, on the model's device. Without it only parameters are counted.

    Example: ``scan_model(*examples.tiny_gpt.make_model())``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"scan_model needs a torch.nn.Module but got {type(model).__name__}.")
    parameter_kinds = _parameter_kinds(model)
    named_parameters = dict(model.named_parameters())
    storages = {
        key: fqn
        for fqn, parameter in named_parameters.items()
        if (key := storage_key(parameter)) is not None
    }
    attribution = FlopAttribution(storages)
    ran, forward_error, running, running_error = _run_scans(model, example_input, attribution)
    total_params = sum(count for _, count in parameter_kinds.values())
    forward_flops = sum(attribution.flops_by_kind.values()) if ran else None
    by_kind = _kind_shares(parameter_kinds, attribution if ran else None)
    linears = _linear_infos(model, attribution if ran else None)
    eligible_flops = sum(linear.flops or 0 for linear in linears if linear.fp8_compatible)
    mix_without_findings = LayerMix(
        model_class=type(model).__name__,
        parameters=total_params,
        trainable_parameters=sum(p.numel() for p in named_parameters.values() if p.requires_grad),
        parameters_in_large_tensors=sum(
            p.numel() for p in named_parameters.values() if p.numel() >= BNB_MIN_8BIT_SIZE
        ),
        by_kind=by_kind,
        forward_flops=forward_flops,
        forward_error=forward_error,
        linears=linears,
        fp8_eligible_flop_share=_share(eligible_flops, forward_flops or 0) if ran else None,
        raw_param_matmuls=tuple(attribution.raw_params),
        keep_fp32=_default_keep_fp32(model, attribution.compute_order, running),
        findings=(),
        complex_parameters=tuple(
            fqn for fqn, p in named_parameters.items() if p.requires_grad and p.is_complex()
        ),
        sparse_gradient_modules=tuple(
            fqn
            for fqn, module in model.named_modules()
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
            and module.sparse
            and module.weight.requires_grad
        ),
        running_buffers=running,
        running_buffers_error=running_error,
    )
    findings = _findings(mix_without_findings)
    if (not_fp32 := non_fp32_weights(model)) is not None:
        findings.insert(
            0,
            f"weights not fp32 ({not_fp32}): tune, check and apply start from fp32 weights; "
            "pass model.float()",
        )
    return mix_without_findings.model_copy(update={"findings": tuple(findings)})


RUNNING_STATE_REASON = "running statistics"
"""How the keep-list names a module whose buffers training updates (pure bf16 keeps it fp32)."""
PURE_BF16_KEEP_REASONS = ("normalisation", "embedding", RUNNING_STATE_REASON)
"""The keep-list reasons pure-bf16 candidates keep in fp32 (the others are FP8's)."""


def _running_state_modules(running: tuple[str, ...], kept: dict[str, str]) -> list[KeepFp32]:
    """A keep entry for each module below the root that owns a running buffer and is not kept
    already as a norm or embedding: in bf16 its updates round to nearest, whatever rounding the
    optimizer uses, and an EMA's small ones vanish (``benchmarks/running_state_rounding.py``)."""
    owners: dict[str, list[str]] = {}
    for fqn in running:
        owner, _, name = fqn.rpartition(".")
        if owner:
            owners.setdefault(owner, []).append(name)
    entries: list[KeepFp32] = []
    for owner, names in owners.items():
        if kept.get(owner, "").startswith(PURE_BF16_KEEP_REASONS):
            continue
        entries.append(
            KeepFp32(
                fqn=owner,
                reason=f"{RUNNING_STATE_REASON}: training updates its buffers "
                f"({', '.join(names)}) outside the optimizer; in bf16 small updates round away",
            )
        )
    return entries


def _default_keep_fp32(
    model: nn.Module, compute_order: list[str], running: tuple[str, ...] = ()
) -> tuple[KeepFp32, ...]:
    keep: dict[str, str] = {}
    compute_layers = compute_order or [
        fqn for fqn, module in model.named_modules() if module_kind(module) in ("linear", "conv")
    ]
    matmul_layers = [
        fqn for fqn in compute_layers if module_kind(model.get_submodule(fqn)) != "embedding"
    ]
    for fqn, module in model.named_modules():
        kind = module_kind(module)
        if kind == "norm":
            keep[fqn] = "normalisation: statistics need full precision"
        elif kind == "embedding":
            keep[fqn] = "embedding: a lookup, nothing for low precision to speed up"
    if matmul_layers:
        keep.setdefault(matmul_layers[0], "first layer: sees raw inputs")
        keep.setdefault(matmul_layers[-1], "last layer: produces the outputs the loss sees")
    for fqn, module in model.named_modules():
        if (
            isinstance(module, nn.Linear)
            and not is_bnb_4bit(module)
            and not fp8_linear_fits(module)
        ):
            keep.setdefault(
                fqn,
                f"Linear {module.in_features}x{module.out_features}: dimensions not divisible "
                f"by {FP8_DIM_MULTIPLE}, FP8 kernels cannot take it",
            )
    entries = [KeepFp32(fqn=fqn, reason=reason) for fqn, reason in keep.items()]
    return tuple(entries + _running_state_modules(running, keep))


def _percent(share: float) -> str:
    return f"{share * 100:.0f}%"


def _findings(mix: LayerMix) -> list[str]:
    findings: list[str] = []
    if mix.parameters == 0:
        findings.append("the model has no parameters: there is nothing to train")
        return findings
    if mix.forward_flops is None:
        reason = f" ({mix.forward_error})" if mix.forward_error else ""
        findings.append(
            "no forward pass ran" + reason + ": FLOP shares are unknown; give an example input"
        )
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
    if (other.flop_share or 0) >= 0.2:
        findings.append(
            f"{_percent(other.flop_share or 0)} of FLOPs are matmuls between activations "
            "(e.g. attention scores): autocast lowers their precision, FP8 Linear swaps do not"
        )
    conv1d = [linear for linear in mix.linears if linear.hf_conv1d]
    if conv1d:
        conv1d_share = _share(sum(linear.flops or 0 for linear in conv1d), mix.forward_flops)
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
            f"carry {_percent(_share(sum(q.flops or 0 for q in quantized), mix.forward_flops))} "
            "of FLOPs: their weights stay 4-bit in every mode and FP8 does not convert them"
        )
    if mix.linears:
        compatible = mix.fp8_compatible_linears
        share = mix.fp8_eligible_flop_share or 0.0
        findings.append(
            f"{len(compatible)} of {len(mix.linears)} Linear layers fit FP8 kernels (both dims "
            f"divisible by {FP8_DIM_MULTIPLE}), carrying {_percent(share)} of FLOPs"
        )
        if compatible and not any(linear.fp8_worthwhile for linear in compatible):
            largest = max(compatible, key=lambda linear: linear.in_features * linear.out_features)
            findings.append(
                f"all FP8-compatible Linears are small (largest {largest.in_features}x"
                f"{largest.out_features}): FP8 casting overhead likely exceeds the gain"
            )
    elif (linear.flop_share or 0) == 0 and (conv.flop_share or 0) < 0.5:
        findings.append("the model has no nn.Linear layers: FP8 module swapping has nothing to do")
    large_share = _share(mix.parameters_in_large_tensors, mix.parameters)
    if large_share < 0.5:
        findings.append(
            f"only {_percent(large_share)} of parameters sit in tensors of >= {BNB_MIN_8BIT_SIZE} "
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
    kept = [keep.fqn for keep in mix.keep_fp32 if keep.reason.startswith(RUNNING_STATE_REASON)]
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
