"""Model scan: parameters and forward FLOPs by layer kind, FP8 fit, fp32 keep-list defaults.

One forward pass under a dispatch mode attributes every matmul, convolution and attention FLOP
(``torch.utils.flop_counter`` formulas) to the innermost module kind it ran in. Matmuls outside
any Linear/Conv module whose operand is a parameter held directly by a custom module
(``x @ self.W``) are counted as ``raw_param``: FP8 module swapping cannot reach them. Matmuls
between activations (attention scores) are ``other``.

The scan runs in eval mode under ``torch.no_grad()`` and restores every module's training
flag, so the model's parameters (rebound ones put back; one a forward writes in place is not),
buffers (BatchNorm statistics), gradients and modes are left as they were (bitsandbytes'
4-bit Linears stay in training mode: in eval mode they repack their weights for CPU inference,
and the model then fails to train). It runs wherever the model
lives: CPU, or the meta device for models too big to materialise.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from autoprec.layer_findings import findings as scan_findings
from autoprec.layer_findings import fraction
from autoprec.layer_flops import NEEDS_GRADIENTS, FlopAttribution, run_forward, storage_key
from autoprec.layer_keep import default_keep_fp32
from autoprec.layer_kinds import (
    BNB_MIN_8BIT_SIZE,
    LAYER_KINDS,
    LayerKind,
    computes_weight,
    fp8_linear_fits,
    fp8_worthwhile,
    is_bnb_4bit,
    is_fp8_linear,
    is_hf_conv1d,
    linear_dims,
    module_kind,
    refuse_lazy,
    refuse_torchscript,
    swap_would_drop,
)
from autoprec.layer_mix import KindShare, LayerMix, LinearInfo
from autoprec.running_state import running_buffers
from autoprec.weight_dtypes import fp32_fix, non_fp32_weights

logger = logging.getLogger(__name__)


def _parameter_kinds(model: nn.Module) -> dict[str, tuple[LayerKind, int]]:
    """fqn -> (kind of the owning module, element count), each shared parameter once."""
    seen: set[int] = set()
    result: dict[str, tuple[LayerKind, int]] = {}
    modules = dict(model.named_modules())
    for module_fqn, module in modules.items():
        kind = module_kind(module) or "raw_param"
        if isinstance(module, ParametrizationList):  # a parametrized weight's: its owner's
            # "<owner>.parametrizations.<name>", the owner "" at the model's root (an rsplit
            # on ".parametrizations." missed it there: a root weight_norm Linear was raw_param)
            owner = modules.get(".".join(module_fqn.split(".")[:-2]))
            kind = (module_kind(owner) if owner is not None else None) or "raw_param"
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            result[fqn] = (kind, parameter.numel())
    return result


def _run_scans(
    model: nn.Module, example_input: Any, attribution: FlopAttribution
) -> tuple[bool, str | None, tuple[str, ...], str | None]:
    """Run the forward scans on ``example_input`` (None: none): whether the FLOP-counting
    forward ran, its error, the running buffers a training-mode forward updates, that
    forward's error. A failed forward is reported (and logged), never raised."""
    if example_input is None:
        return False, None, (), None
    with _parameters_kept(model):
        return _scans(model, example_input, attribution)


@contextlib.contextmanager
def _parameters_kept(model: nn.Module) -> Iterator[None]:
    """The parameters' tensors held through the scans, and put back where a forward rebound
    them (a momentum encoder's ``p.data = m * p.data + ...``: MoCo's key encoder came back
    changed from ``probe()``, and the storages it freed were reused by tensors the forward
    made, which the scan then named as raw-parameter matmuls at random, 12 scans in 40;
    found by a hunt). A parameter written in place is not put back."""
    held = [(parameter, parameter.data) for parameter in model.parameters()]
    try:
        yield
    finally:
        for parameter, data in held:
            if parameter.data_ptr() != data.data_ptr() or parameter.shape != data.shape:
                parameter.data = data


def _scans(
    model: nn.Module, example_input: Any, attribution: FlopAttribution
) -> tuple[bool, str | None, tuple[str, ...], str | None]:
    """:func:`_run_scans` with an example input."""
    try:
        grad = _count_flops(model, example_input, attribution)
    except Exception as error:  # noqa: BLE001 - a failed forward is reported, not raised
        forward_error = f"{type(error).__name__}: {error}".splitlines()[0]
        logger.warning("forward pass for the model scan failed: %s", forward_error)
        return False, forward_error, (), None
    try:
        return True, None, running_buffers(model, example_input, grad), None
    except Exception as error:  # noqa: BLE001 - reported as a finding, not raised
        running_error = f"{type(error).__name__}: {error}".splitlines()[0]
        logger.warning("training-mode forward for the model scan failed: %s", running_error)
        return True, None, (), running_error


def _count_flops(model: nn.Module, example_input: Any, attribution: FlopAttribution) -> bool:
    """The FLOP-counting forward in training mode, as training runs the model: run in eval
    mode, a head only training calls (deep supervision, an auxiliary loss) counted no FLOPs,
    and FP8 called it "never called as a module" (found by a hunt). A forward training mode
    refuses (BatchNorm on one example, a detector that wants targets) runs in eval mode; one
    that differentiates by its inputs, with gradients (``NEEDS_GRADIENTS``). Whether it ran
    with gradients."""
    try:
        with warnings.catch_warnings():  # the eval-mode forward below says what matters
            warnings.simplefilter("ignore")
            run_forward(model, example_input, attribution, training=True)
    except Exception as error:  # noqa: BLE001 - retried, and the retry's error is reported
        attribution.reset()
        if NEEDS_GRADIENTS in str(error):
            run_forward(model, example_input, attribution, training=True, grad=True)
            return True
        run_forward(model, example_input, attribution, training=False)
    return False


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
                parameter_share=fraction(parameters, total_params),
                flops=flops,
                flop_share=None if flops is None else fraction(flops, forward_flops),
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
        transformed = attribution is not None and fqn in attribution.under_transform
        compatible = fp8_linear_fits(module) and not transformed
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
                computed_weight=computes_weight(module),
                swap_drops=swap_would_drop(module) is not None,
                already_fp8=is_fp8_linear(module),
                under_transform=transformed,
            )
        )
    return tuple(infos)


def model_class_name(model: nn.Module) -> str:
    """The model's class as its fingerprint names it: for a model FSDP2 sharded, the class it
    wrapped (``fully_shard`` swaps in a class ``FSDP<Name>``, and a profile proven on the
    unsharded ``Name`` warned "proven for another model" on the route the docs give: shard
    first, then apply; found by a review)."""
    cls = type(model)
    fsdp = _fsdp_module_class()
    if fsdp is not None and fsdp in cls.__bases__:
        wrapped = [base for base in cls.__bases__ if base is not fsdp]
        if wrapped:
            return wrapped[0].__name__
    return cls.__name__


def _fsdp_module_class() -> type | None:
    """torch's ``FSDPModule`` (a user's class of that name is not it: a review), when this
    torch has it and FSDP2 is loaded (a sharded model has imported it)."""
    module = sys.modules.get("torch.distributed.fsdp")
    return getattr(module, "FSDPModule", None) if module is not None else None


def scan_model(model: nn.Module, example_input: Any = None) -> LayerMix:
    """Scan ``model``: parameter and FLOP shares by layer kind, FP8 fit, fp32 keep-list.

    Args:
        model: the model to scan. It is run once without gradients in training mode (in eval
            mode when training mode fails); its modes, buffers and RNG are put back.
        example_input: a tensor, a tuple of positional arguments or a dict of keyword
            arguments, on the model's device. Without it only parameters are counted.

    Example: ``scan_model(*examples.tiny_gpt.make_model())``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"scan_model needs a torch.nn.Module but got {type(model).__name__}.")
    refuse_torchscript(model)
    refuse_lazy(model)
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
        model_class=model_class_name(model),
        parameters=total_params,
        trainable_parameters=sum(p.numel() for p in named_parameters.values() if p.requires_grad),
        parameters_in_large_tensors=sum(
            p.numel()
            for p in named_parameters.values()
            if p.requires_grad and p.numel() >= BNB_MIN_8BIT_SIZE
        ),
        by_kind=by_kind,
        forward_flops=forward_flops,
        forward_error=forward_error,
        linears=linears,
        fp8_eligible_flop_share=fraction(eligible_flops, forward_flops or 0) if ran else None,
        raw_param_matmuls=tuple(attribution.raw_params),
        keep_fp32=default_keep_fp32(
            model,
            list(attribution.compute_order),
            running,
            tuple(attribution.under_transform),
            raw_matmuls=tuple(attribution.raw_params) if ran else (),
            raw_at_end=attribution.raw_at_end if ran else (),
            called=tuple(attribution.called) if ran else None,
        ),
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
        lstm_modules=tuple(  # with proj_size torch does not use oneDNN, and fp16 runs (a hunt)
            fqn
            for fqn, module in model.named_modules()
            if isinstance(module, nn.LSTM) and not module.proj_size
        ),
        running_buffers=running,
        running_buffers_error=running_error,
        weights_not_fp32=non_fp32_weights(model),
        forward_autocast=attribution.autocast_at if ran else None,
    )
    findings = scan_findings(mix_without_findings)
    if mix_without_findings.weights_not_fp32 is not None:
        findings.insert(
            0,
            f"weights not fp32 ({mix_without_findings.weights_not_fp32}): tune, check and "
            f"apply start from fp32 weights and refuse these. {fp32_fix(model)}",
        )
    return mix_without_findings.model_copy(update={"findings": tuple(findings)})
