"""FSDP2 (``torch.distributed.fsdp.fully_shard``): MixedPrecisionPolicy arguments."""

from __future__ import annotations

from typing import Any

import torch

from autoprec.errors import ExportError
from autoprec.integrations import refuse_8bit_optimizer, refuse_cudnn_tf32, refuse_keep_fp32
from autoprec.recipe import RecipeSummary
from autoprec.specs import ModeSpec


def fsdp2_policy_args(
    spec: ModeSpec,
    *,
    ignore_keep_fp32: bool = False,
    recipe: RecipeSummary | None = None,
    cudnn_kinds: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``MixedPrecisionPolicy(**fsdp2_policy_args(spec))`` keyword arguments.

    FSDP2 casts the sharded fp32 parameters to ``param_dtype`` for forward and backward and
    reduces gradients in ``reduce_dtype``. That is not autocast: with ``param_dtype=bfloat16``
    every op runs in bf16, norms, softmax and the loss included, which autocast (what amp_bf16
    trials measure) keeps in fp32. So amp_bf16 is refused with the exact route: an fp32 policy
    under ``torch.autocast``.
    """
    refuse_keep_fp32(spec, "MixedPrecisionPolicy", ignore_keep_fp32)
    refuse_8bit_optimizer(spec, "FSDP2", "build {cls} over the sharded parameters.", recipe)
    if spec.compile:
        raise ExportError(
            "MixedPrecisionPolicy has no compile setting, and this profile was proven compiled: "
            "compile the model yourself (torch.compile after fully_shard) and export a profile "
            "of the same mode without compile=True, or tune with your compiled model."
        )
    refuse_cudnn_tf32(
        spec,
        cudnn_kinds,
        "An fp32 MixedPrecisionPolicy",
        "Use MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)",
        None,
    )
    if spec.mode == "fp32":
        return {"param_dtype": torch.float32, "reduce_dtype": torch.float32}
    if spec.mode == "amp_bf16":
        raise ExportError(
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16) runs every op in bf16 (norms, "
            "softmax and the loss included), which amp_bf16's autocast keeps in fp32: not what "
            "this profile proved. Use MixedPrecisionPolicy(param_dtype=torch.float32, "
            "reduce_dtype=torch.float32) and run forward and loss under torch.autocast(device, "
            "dtype=torch.bfloat16), as the trials did."
        )
    if spec.mode == "amp_fp16":
        raise ExportError(
            "MixedPrecisionPolicy has no loss scaling, which fp16 needs, and its "
            "param_dtype=torch.float16 would run every op in fp16 (norms, softmax and the loss "
            "included), which amp_fp16's autocast keeps in fp32: not what this profile proved. "
            "Use MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32), "
            "run forward and loss under torch.autocast(device, dtype=torch.float16), and scale "
            "with torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, as the trials "
            "did (found by a hunt: it advised param_dtype=torch.float16)."
        )
    if spec.mode == "tf32":
        raise ExportError(
            "MixedPrecisionPolicy has no TF32 setting: use param_dtype=torch.float32 and call "
            "torch.set_float32_matmul_precision('high')."
        )
    raise ExportError(
        f"MixedPrecisionPolicy cannot express {spec.mode}, and autoprec does not run it under "
        "FSDP2: fully_shard after profile.apply() replaces every parameter, so plan.optimizer "
        "steps none of them (plan.step refuses that), and a model sharded before apply() is "
        "refused (FSDP2 recorded its dtypes and modules). Under FSDP2 use an fp32, tf32, "
        "amp_bf16 or amp_fp16 profile, applied to the sharded model (fully_shard first, then "
        "profile.apply()); train this one under DDP (wrap plan.model; found by a hunt: the "
        "route this message gave trained nothing)."
    )
