"""Hugging Face Trainer: ``TrainingArguments(..., **hf_training_args(spec))``."""

from __future__ import annotations

from typing import Any

from autoprec.errors import ExportError, check_flag
from autoprec.integrations import bnb_8bit_class, refuse_keep_fp32
from autoprec.recipe import RecipeSummary
from autoprec.specs import ModeSpec

_FLAGS = {
    "fp32": {"bf16": False, "fp16": False, "tf32": False},
    "tf32": {"bf16": False, "fp16": False, "tf32": True},
    "amp_fp16": {"bf16": False, "fp16": True},
    "amp_bf16": {"bf16": True, "fp16": False},
}


EMBEDDING_STATES = (
    "TrainingArguments(optim='adamw_bnb_8bit') is not this profile's recipe for a model with "
    "embeddings: Trainer.create_optimizer registers a bitsandbytes override that keeps every "
    "nn.Embedding weight's Adam states in 32 bits (process-wide, for later 8-bit optimizers "
    "too), and autoprec's 8-bit trials kept them 8-bit (found by a hunt: a GPT-2's wte states "
    "took 131072 bytes under the export, 35328 as proven). Use "
    "autoprec.integrations.hf.apply_profile(trainer, profile); for a model without "
    "nn.Embedding pass to_hf_training_args(no_embeddings=True)."
)


def hf_training_args(
    spec: ModeSpec,
    *,
    ignore_keep_fp32: bool = False,
    recipe: RecipeSummary | None = None,
    no_embeddings: bool = False,
) -> dict[str, Any]:
    """TrainingArguments fields (bf16, fp16, tf32, optim, torch_compile) for the spec.
    ``no_embeddings``: the model has no ``nn.Embedding``, whose optimizer states the
    Trainer's 8-bit optimizer keeps in 32 bits (see ``EMBEDDING_STATES``)."""
    refuse_keep_fp32(spec, "TrainingArguments", ignore_keep_fp32)
    check_flag(no_embeddings, "no_embeddings")
    if spec.mode not in _FLAGS:
        hint = (
            "TrainingArguments has no FP8 flag: use to_accelerate() with an Accelerate config"
            if spec.mode.startswith("fp8")
            else "the Trainer's only Kahan path is optim='adamw_anyprecision' on a model you "
            "cast to bf16 yourself, and it has no stochastic rounding"
        )
        raise ExportError(
            f"TrainingArguments cannot express {spec.mode} ({hint}); use "
            "autoprec.integrations.hf.apply_profile(trainer, profile) on a Trainer built "
            "without bf16/fp16: it installs the profile's plan through the Trainer's own hooks."
        )
    args = dict(_FLAGS[spec.mode])
    if spec.compile:
        if spec.mode == "fp32":  # the Trainer compiles through Accelerate, which turns TF32 on
            raise ExportError(
                "TrainingArguments(torch_compile=True, tf32=False) does not train in fp32: the "
                "Trainer hands the compile to Accelerate, which turns TF32 matmuls on for a "
                "full-precision compile (accelerate/state.py). Compile the model yourself "
                "before building the Trainer and leave torch_compile off, or use "
                "autoprec.integrations.hf.apply_profile(trainer, profile), whose fp32 steps "
                "keep TF32 off."
            )
        args["torch_compile"] = True
    if spec.optimizer_bits == 8:
        proven = bnb_8bit_class(recipe)
        if proven not in (None, "bitsandbytes.optim.AdamW8bit"):
            raise ExportError(
                f"TrainingArguments' 8-bit optimizer (optim='adamw_bnb_8bit') is AdamW8bit, but "
                f"this profile was proven with {recipe.optimizer if recipe else '?'} and its "
                f"8-bit states ({proven}): pass Trainer(optimizers=({proven}(...), None)) with "
                "the same hyper-parameters, or use "
                "autoprec.integrations.hf.apply_profile(trainer, profile)."
            )
        if not no_embeddings:
            raise ExportError(EMBEDDING_STATES)
        args["optim"] = "adamw_bnb_8bit"  # the Trainer's default optimizer is AdamW
    return args
