"""Lightning (Trainer or Fabric): the ``precision`` argument for a ModeSpec; and, loaded on first
use, ``tune_module`` and the ``AutoprecPrecision`` plugin (``lightning_trainer``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoprec.errors import ExportError, MissingBackendError
from autoprec.integrations import refuse_8bit_optimizer, refuse_cudnn_tf32, refuse_keep_fp32
from autoprec.recipe import RecipeSummary
from autoprec.specs import ModeSpec

if TYPE_CHECKING:  # their real types for type checkers; at run time `__getattr__` loads them
    from autoprec.integrations.lightning_trainer import AutoprecPrecision as AutoprecPrecision
    from autoprec.integrations.lightning_trainer import module_recipe as module_recipe
    from autoprec.integrations.lightning_trainer import tune_module as tune_module

_PRECISION = {
    "fp32": "32-true",
    "amp_fp16": "16-mixed",
    "amp_bf16": "bf16-mixed",
    "bf16_pure": "bf16-true",  # Lightning's bf16-true is pure bf16 with nearest rounding
}


def lightning_settings(
    spec: ModeSpec,
    *,
    ignore_keep_fp32: bool = False,
    recipe: RecipeSummary | None = None,
    complex_parameters: tuple[str, ...] = (),
    cudnn_kinds: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``Trainer(**lightning_settings(spec))`` / ``Fabric(**...)`` keyword arguments
    (``complex_parameters``: the proven model's, which ``bf16-true`` would cast to real;
    ``cudnn_kinds``: its layer kinds cuDNN runs, in TF32 under ``32-true``)."""
    refuse_keep_fp32(spec, "Lightning's precision flag", ignore_keep_fp32)
    refuse_8bit_optimizer(
        spec,
        "Lightning",
        "return {cls} (same hyper-parameters) from configure_optimizers.",
        recipe,
    )
    if spec.compile:
        raise ExportError(
            "Lightning's Trainer has no compile flag: compile the LightningModule yourself "
            "(model = torch.compile(model)) before trainer.fit, or use "
            "Trainer(plugins=[AutoprecPrecision(profile)]), which compiles it as proven."
        )
    if spec.mode == "bf16_pure" and recipe is not None and recipe.grad_accumulation_steps > 1:
        raise ExportError(
            f"This bf16_pure profile was proven with {recipe.grad_accumulation_steps} "
            "micro-batches a step, which autoprec sums in fp32 and rounds once; Lightning's "
            "precision='bf16-true' sums them in bf16 .grad, rounding at every micro-batch "
            "(3.1e-3 relative error over 8 micro-batches against 1.7e-3 on a TinyGPT). Use "
            "Trainer(plugins=[autoprec.integrations.lightning.AutoprecPrecision(profile)])."
        )
    if spec.mode == "bf16_pure" and complex_parameters:
        raise ExportError(
            "Lightning's precision='bf16-true' casts the whole module to bfloat16, which drops "
            "the imaginary part of complex parameters (found: "
            f"{', '.join(complex_parameters[:3])}); autoprec's bf16_pure keeps them complex. "
            "Use Trainer(plugins=[autoprec.integrations.lightning.AutoprecPrecision(profile)])."
        )
    refuse_cudnn_tf32(
        spec,
        cudnn_kinds,
        "Lightning's precision='32-true'",
        "Use precision='32-true'",
        "Trainer(plugins=[autoprec.integrations.lightning.AutoprecPrecision(profile)])",
    )
    if spec.mode in _PRECISION:
        return {"precision": _PRECISION[spec.mode]}
    if spec.mode == "tf32":
        raise ExportError(
            "Lightning's precision flag has no TF32 setting: use precision='32-true' and call "
            "torch.set_float32_matmul_precision('high') before training."
        )
    if spec.mode == "fp8_te":
        raise ExportError(
            "Lightning's precision='transformer-engine' keeps bf16 weights and TE's default "
            "recipe, not this profile's fp32 weights and recipe "
            f"({spec.fp8_recipe}, {spec.te_delayed_scaling}). Pass "
            "plugins=TransformerEnginePrecision(weights_dtype=torch.float32, recipe=...) with "
            "that recipe, or use profile.apply()."
        )
    raise ExportError(
        f"Lightning has no precision setting for {spec.mode} (stochastic rounding, Kahan "
        "summation and torchao float8 need autoprec's optimizer or module conversion): use "
        "Trainer(plugins=[autoprec.integrations.lightning.AutoprecPrecision(profile)]), which "
        "runs any profile under automatic optimization."
    )


class LightningMissingError(MissingBackendError, ImportError):
    """Lightning is not installed: an ImportError too, so ``try: from
    autoprec.integrations.lightning import AutoprecPrecision / except ImportError:`` falls
    back as it did when the bare ``No module named 'lightning'`` came through (found by a
    review)."""


def __getattr__(name: str) -> Any:
    """``tune_module`` and ``AutoprecPrecision`` import Lightning: loaded on first use, so that
    profiles export to Lightning without importing it."""
    if name in ("tune_module", "AutoprecPrecision", "module_recipe"):
        try:
            from autoprec.integrations import lightning_trainer
        except ImportError as error:
            if (error.name or "").split(".")[0] != "lightning":
                raise
            # a bare "No module named 'lightning'" before (found by a hunt)
            raise LightningMissingError(
                f"autoprec.integrations.lightning.{name} needs Lightning 2.x, imported as "
                f"`lightning` ({type(error).__name__}: {error}); install it with: pip install "
                "lightning (the standalone pytorch_lightning package is not supported)"
            ) from error
        return getattr(lightning_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
