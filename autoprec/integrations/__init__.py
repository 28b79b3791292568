"""Translate a ModeSpec into other frameworks' settings.

Each function returns exactly what the framework needs for the same recipe, or raises
:class:`~autoprec.errors.ExportError` saying what the framework cannot express and what to do
instead (usually: use ``profile.apply(model, optimizer)`` in your own loop). Nothing is ever
approximated silently.
"""

from __future__ import annotations

from autoprec.errors import ExportError, check_flag
from autoprec.optim import BNB_8BIT
from autoprec.recipe import RecipeSummary
from autoprec.specs import OWN_OPTIMIZER_MODES, ModeSpec

# Modes whose numerics do not depend on where keep_fp32 modules run.
_FULL_PRECISION = ("fp32", "tf32")


def refuse_keep_fp32(spec: ModeSpec, target: str, ignore_keep_fp32: bool) -> None:
    """keep_fp32 cannot be expressed by framework flags: refuse unless told to drop it."""
    check_flag(ignore_keep_fp32, "ignore_keep_fp32")
    if spec.keep_fp32 and spec.mode not in _FULL_PRECISION and not ignore_keep_fp32:
        raise ExportError(
            f"{target} cannot keep modules {list(spec.keep_fp32)} in fp32 under {spec.mode}. "
            "Use profile.apply(model, optimizer) in your loop, "
            "autoprec.integrations.hf.apply_profile(trainer, profile) for a Hugging Face "
            "Trainer, or Trainer(plugins=[autoprec.integrations.lightning.AutoprecPrecision("
            "profile)]) for Lightning; or pass ignore_keep_fp32=True to export the mode without "
            "them (a different recipe from the one that was proven)."
        )


CUDNN_KINDS = {"conv": "convolutions", "recurrent": "recurrent layers (LSTM, GRU, RNN)"}
"""Layer kinds cuDNN runs on CUDA, named as messages name them: ``cudnn.allow_tf32`` (on by
default in torch) decides whether they run in TF32."""


def refuse_cudnn_tf32(
    spec: ModeSpec, cudnn_kinds: tuple[str, ...], target: str, how: str, instead: str | None
) -> None:
    """Refuse an fp32 export for a model with layers cuDNN runs: the framework's full precision
    leaves ``torch.backends.cudnn.allow_tf32`` at torch's default, True, so they would run in
    TF32, where autoprec's fp32 (the reference every mode was judged against) turns it off.
    ``how`` is the framework's own route, ``instead`` autoprec's."""
    if spec.mode != "fp32" or not cudnn_kinds:
        return
    kinds = " and ".join(CUDNN_KINDS.get(kind, kind) for kind in cudnn_kinds)
    raise ExportError(
        f"{target} leaves cuDNN's TF32 at torch's default (on), so this model's {kinds} would "
        "run in TF32 on a GPU; the profile was proven in fp32 with TF32 off. "
        f"{how} and set torch.backends.cudnn.allow_tf32 = False before training"
        + (f", or use {instead}, whose fp32 steps keep it off." if instead else ".")
    )


def bnb_8bit_class(recipe: RecipeSummary | None) -> str | None:
    """The bitsandbytes class the profile's 8-bit states were proven with, as
    ``optim.rebuild_optimizer`` picks it from the recipe's optimizer (``optim.source_kind``;
    None for a profile without a recipe)."""
    if recipe is None:
        return None
    kind = recipe.optimizer.rpartition(":")[2].lower()
    decoupled = any(group.get("decoupled_weight_decay") for group in recipe.optimizer_groups)
    if kind == "adam" and decoupled:
        kind = "adamw"
    return f"bitsandbytes.optim.{BNB_8BIT[kind]}" if kind in BNB_8BIT else None


def refuse_8bit_optimizer(
    spec: ModeSpec, target: str, how: str, recipe: RecipeSummary | None
) -> None:
    """8-bit states are an optimizer, which no precision flag builds: say which one to build.
    ``how`` names it as ``{cls}``. A mode of autoprec's own optimizer (bf16_sr's 8-bit
    moments) is left to the mode's own refusal, which names ``profile.apply()``: no
    bitsandbytes class trains it."""
    if spec.optimizer_bits != 8 or spec.mode in OWN_OPTIMIZER_MODES:
        return
    cls = bnb_8bit_class(recipe)
    shown = (
        cls
        or "the bitsandbytes 8-bit class of your optimizer (bitsandbytes.optim.AdamW8bit for AdamW)"
    )
    raise ExportError(
        f"{target} does not build the optimizer from a precision setting; {how.format(cls=shown)}"
    )


__all__ = ["bnb_8bit_class", "refuse_8bit_optimizer", "refuse_keep_fp32"]
