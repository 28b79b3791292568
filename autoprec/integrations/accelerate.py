"""Hugging Face Accelerate: ``Accelerator(**accelerate_settings(spec))``."""

from __future__ import annotations

import importlib
from typing import Any

from autoprec._imports import install_hint
from autoprec.errors import ExportError, MissingBackendError
from autoprec.integrations import refuse_8bit_optimizer, refuse_cudnn_tf32, refuse_keep_fp32
from autoprec.modes.fp8_torchao import Fp8TorchaoMode
from autoprec.recipe import RecipeSummary
from autoprec.specs import ModeSpec, TeDelayedScaling

_MIXED = {"fp32": "no", "amp_fp16": "fp16", "amp_bf16": "bf16"}


def _accelerate_utils() -> Any:
    try:
        return importlib.import_module("accelerate.utils")
    except Exception as error:
        raise MissingBackendError(
            f"Exporting FP8 for Accelerate needs accelerate ({type(error).__name__}: {error}); "
            "install it with: pip install accelerate"
        ) from error


def accelerate_settings(
    spec: ModeSpec,
    *,
    ignore_keep_fp32: bool = False,
    recipe: RecipeSummary | None = None,
    cudnn_kinds: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator`` (``dynamo_backend="inductor"`` when
    the profile was proven compiled; ``cudnn_kinds``: the proven model's layer kinds cuDNN
    runs, in TF32 under ``mixed_precision="no"``)."""
    settings = _precision_settings(spec, ignore_keep_fp32, recipe)
    refuse_cudnn_tf32(
        spec,
        cudnn_kinds,
        "Accelerate's mixed_precision='no'",
        "Use Accelerator(mixed_precision='no')",
        "profile.apply(model, optimizer) before accelerator.prepare()",
    )
    if spec.compile:
        if spec.mode == "fp32":
            raise ExportError(COMPILED_FP32_TURNS_TF32_ON)
        settings["dynamo_backend"] = "inductor"
    return settings


COMPILED_FP32_TURNS_TF32_ON = (
    "Accelerate turns TF32 matmuls on when it compiles a model in full precision "
    "(dynamo_backend with mixed_precision='no' on CUDA: accelerate/state.py sets "
    "torch.backends.cuda.matmul.allow_tf32 = True), and this profile was proven in fp32 with "
    "TF32 off. Build Accelerator(mixed_precision='no') without dynamo_backend and compile the "
    "model yourself (torch.compile), or train with profile.apply(model, optimizer), whose fp32 "
    "steps keep TF32 off."
)
"""Why a compiled fp32 profile has no Accelerate (or Trainer, which compiles through
Accelerate) export: read in accelerate 1.15's ``AcceleratorState``."""


def _precision_settings(
    spec: ModeSpec, ignore_keep_fp32: bool, recipe: RecipeSummary | None
) -> dict[str, Any]:
    refuse_keep_fp32(spec, "Accelerate's mixed_precision", ignore_keep_fp32)
    refuse_8bit_optimizer(
        spec,
        "Accelerate",
        "create {cls} yourself and pass it to accelerator.prepare().",
        recipe,
    )
    if spec.mode in _MIXED:
        return {"mixed_precision": _MIXED[spec.mode]}
    if spec.mode == "fp8_te":
        if spec.fp8_skip:
            raise ExportError(
                f"Accelerate's Transformer Engine path converts every Linear; this profile keeps "
                f"{list(spec.fp8_skip)} out of FP8. Use profile.apply(model, optimizer)."
            )
        if spec.fp8_recipe == "te_current":
            raise ExportError(
                "Accelerate's TERecipeKwargs has no current-scaling recipe; use profile.apply()."
            )
        if spec.fp8_recipe == "te_mxfp8":
            recipe: dict[str, Any] = {"use_mxfp8_block_scaling": True}
        else:
            delayed = spec.te_delayed_scaling or TeDelayedScaling()
            recipe = {
                "fp8_format": "HYBRID" if spec.fp8_recipe == "te_delayed_hybrid" else "E4M3",
                "amax_history_len": delayed.amax_history_len,
                "amax_compute_algo": delayed.amax_compute_algo,
                "margin": delayed.margin,
            }
        try:
            handler = _accelerate_utils().TERecipeKwargs(**recipe)
        except ImportError as error:  # accelerate checks for Transformer Engine here
            raise MissingBackendError(
                f"Accelerate's TERecipeKwargs needs Transformer Engine ({error}); install it "
                f"with: {install_hint('transformer_engine')}"
            ) from error
        _refuse_dropped_te_fields(recipe, handler.to_kwargs())
        return {"mixed_precision": "fp8", "kwargs_handlers": [handler]}
    if spec.mode == "fp8_torchao":
        if spec.emulate:
            raise ExportError(
                "This profile emulates FP8 (a quality screen on hardware without FP8); "
                "Accelerate would run real FP8 kernels. Re-tune on an FP8-capable GPU."
            )
        float8 = importlib.import_module("torchao.float8")
        recipe = (spec.fp8_recipe or "torchao_tensorwise").removeprefix("torchao_")
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        # the profile's own choice of layers (fits, size rule, fp8_skip, keep_fp32), not
        # Accelerate's default filter
        convert = Fp8TorchaoMode(spec).module_filter_fn
        handler = _accelerate_utils().AORecipeKwargs(config=config, module_filter_func=convert)
        return {"mixed_precision": "fp8", "kwargs_handlers": [handler]}
    if spec.mode == "tf32":
        raise ExportError(
            "Accelerator has no TF32 argument: use mixed_precision='no' and call "
            "torch.set_float32_matmul_precision('high') before training."
        )
    raise ExportError(
        f"Accelerate has no mixed_precision setting for {spec.mode}: cast the model and build "
        "the optimizer with profile.apply(model, optimizer), then accelerator.prepare() them "
        "with mixed_precision='no'."
    )


TE_DELAYED_SCALING_DEFAULTS: dict[str, Any] = {
    "fp8_format": "HYBRID",
    "amax_history_len": 1024,
    "amax_compute_algo": "max",
    "margin": 0,
}
"""Transformer Engine's own ``DelayedScaling`` defaults (TE 2.x, ``common/recipe.py``): what a
field Accelerate leaves out becomes."""


def _refuse_dropped_te_fields(recipe: dict[str, Any], handed: dict[str, Any]) -> None:
    """Accelerate hands Transformer Engine only the ``TERecipeKwargs`` fields that differ from
    its own defaults (``to_kwargs``), and TE fills the rest with its own: a profile field equal
    to Accelerate's default but not TE's (``amax_compute_algo='most_recent'``) would silently
    become TE's."""
    lost = {
        name: value
        for name, value in recipe.items()
        if name in TE_DELAYED_SCALING_DEFAULTS
        and handed.get(name, TE_DELAYED_SCALING_DEFAULTS[name]) != value
    }
    if lost:
        shown = ", ".join(
            f"{name}={value!r} (would run as {TE_DELAYED_SCALING_DEFAULTS[name]!r})"
            for name, value in lost.items()
        )
        raise ExportError(
            f"Accelerate would not hand this profile's {shown} to Transformer Engine: its "
            "TERecipeKwargs passes only the fields that differ from its own defaults, and TE "
            "fills the rest with its own. Use profile.apply(model, optimizer), which builds the "
            "recipe itself."
        )
