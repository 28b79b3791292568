"""The vocabulary every stage shares: canonical mode names, FP8 recipes, ModeSpec."""

from __future__ import annotations

import fnmatch
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, model_validator

from autoprec._models import FROZEN_RECORD

ModeName = Literal[
    "fp32",
    "tf32",
    "amp_fp16",
    "amp_bf16",
    "bf16_pure",
    "bf16_sr",
    "bf16_kahan",
    "bf16_sr_kahan",
    "fp8_te",
    "fp8_torchao",
]
"""Canonical, stable mode names used in profiles, reports and on the command line."""

MODE_NAMES: tuple[ModeName, ...] = get_args(ModeName)
PURE_BF16_MODES: tuple[ModeName, ...] = ("bf16_pure", "bf16_sr", "bf16_kahan", "bf16_sr_kahan")
"""Modes whose weights are bf16."""
OWN_OPTIMIZER_MODES: tuple[ModeName, ...] = ("bf16_sr", "bf16_kahan", "bf16_sr_kahan")
"""Modes that rebuild the optimizer as their own (SR, Kahan)."""
OWN_8BIT_MODES: tuple[ModeName, ...] = ("bf16_sr",)
"""Of those, the ones whose own optimizer keeps 8-bit moments with ``optimizer_bits=8``
(``autoprec.eight_bit_states``): bf16 weights and 8-bit states, 4 bytes a parameter. The
Kahan modes are left out: their bf16 buffer takes back the 2 bytes the 8-bit states save."""

MODE_DESCRIPTIONS: dict[ModeName, str] = {
    "fp32": "full fp32, TF32 off (the reference)",
    "tf32": "fp32 weights, TF32 tensor-core matmuls",
    "amp_fp16": "autocast fp16 with dynamic loss scaling, fp32 weights",
    "amp_bf16": "autocast bf16, fp32 weights",
    "bf16_pure": "bf16 weights, grads and optimizer, nearest rounding",
    "bf16_sr": "bf16 weights, stochastic rounding of updates (torchastic)",
    "bf16_kahan": "bf16 weights, Kahan-compensated updates, Adam's second moment fp32",
    "bf16_sr_kahan": "bf16 weights, stochastic rounding and Kahan compensation",
    "fp8_te": "FP8 matmuls with Transformer Engine",
    "fp8_torchao": "FP8 matmuls with torchao float8 training",
}

Fp8Recipe = Literal[
    "te_delayed_hybrid",
    "te_delayed_e4m3",
    "te_current",
    "te_mxfp8",
    "torchao_tensorwise",
    "torchao_rowwise",
]
"""FP8 scaling recipes. ``te_*`` belong to ``fp8_te``, ``torchao_*`` to ``fp8_torchao``."""

FP8_RECIPES: tuple[Fp8Recipe, ...] = get_args(Fp8Recipe)

OptimizerBits = Literal[32, 8]
"""Optimizer-state precision: 32-bit (the optimizer's own) or 8-bit (bitsandbytes)."""

DEFAULT_FP8_RECIPE: dict[str, Fp8Recipe] = {
    "fp8_te": "te_delayed_hybrid",
    "fp8_torchao": "torchao_tensorwise",
}


class TeDelayedScaling(BaseModel):
    """Transformer Engine delayed-scaling settings, stored in full (wrappers disagree on the
    defaults: TE 1024/max, Accelerate 1024/most_recent, Composer 16/max)."""

    model_config = FROZEN_RECORD

    amax_history_len: int = Field(default=1024, ge=1)
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    margin: int = Field(default=0, ge=0)


class ModeSpec(BaseModel):
    """One complete precision setup: a mode and its knobs."""

    model_config = FROZEN_RECORD

    mode: ModeName
    optimizer_bits: OptimizerBits = 32
    fp8_recipe: Fp8Recipe | None = None
    keep_fp32: tuple[str, ...] = ()
    """Module-name patterns kept in full precision: fp32 weights, autocast off."""
    fp8_skip: tuple[str, ...] = ()
    """FP8 modes: module-name patterns kept out of FP8. They run in the mode's bf16 autocast,
    as torchtitan and Accelerate run the layers they keep out of FP8 — not in fp32, which is
    what ``keep_fp32`` asks for (tune() puts the first and last layers here, not there)."""
    emulate: bool = False
    """fp8_torchao only: run FP8 numerics without FP8 hardware (quality screening, no speed)."""
    te_delayed_scaling: TeDelayedScaling | None = None
    """Filled in for the ``te_delayed_*`` recipes so a profile never relies on TE defaults."""
    compile: bool = False
    """Compile the model with ``torch.compile`` (inductor; its ``forward``, in place):
    trials train compiled (compilation in their warm-up) and ``apply()`` compiles the same
    way. FP8 needs it to pay (torchao: eager float8 is slower than bf16)."""
    fp8_layers: Literal["worthwhile", "all"] | None = None
    """fp8_torchao: which FP8-compatible Linears convert. ``"worthwhile"`` (the default):
    torchao's own size rule for the recipe, from its H100 benchmarks — smaller Linears lose more
    to their casts than FP8 gains (a 1024x2048x1024 layer runs 0.80x) and stay in the mode's
    bf16 autocast; ``"all"``: every Linear FP8 kernels take (the quality screen uses it, the
    strictest answer to "would FP8 hurt my model")."""

    @model_validator(mode="before")
    @classmethod
    def _complete_fp8_recipe(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        mode = data.get("mode")
        if mode in DEFAULT_FP8_RECIPE and data.get("fp8_recipe") is None:
            data["fp8_recipe"] = DEFAULT_FP8_RECIPE[mode]
        recipe = data.get("fp8_recipe")
        if isinstance(recipe, str) and recipe.startswith("te_delayed"):
            data.setdefault("te_delayed_scaling", TeDelayedScaling())
        if mode == "fp8_torchao" and data.get("fp8_layers") is None:
            data["fp8_layers"] = "worthwhile"
        return data

    @model_validator(mode="after")
    def _knobs_fit_mode(self) -> ModeSpec:
        if self.fp8_recipe is not None:
            family = self.fp8_recipe.split("_", 1)[0]
            if self.mode != f"fp8_{family}":
                raise ValueError(
                    f"fp8_recipe {self.fp8_recipe!r} belongs to mode 'fp8_{family}', "
                    f"not {self.mode!r}."
                )
        if (
            self.optimizer_bits == 8
            and self.mode in OWN_OPTIMIZER_MODES
            and self.mode not in OWN_8BIT_MODES
        ):
            raise ValueError(
                f"optimizer_bits=8 does not compose with {self.mode!r}: it brings its own "
                "optimizer implementation (Kahan summation, whose bf16 buffer costs what 8-bit "
                "states save). Use bf16_sr (stochastically rounded weights, 8-bit states), "
                "bf16_pure or an AMP mode with optimizer_bits=8."
            )
        if self.emulate and self.mode != "fp8_torchao":
            raise ValueError(f"emulate=True applies only to 'fp8_torchao', not {self.mode!r}.")
        if self.keep_fp32 and self.mode == "tf32":
            raise ValueError(
                "keep_fp32 does not apply to 'tf32': TF32 is one global matmul setting inside "
                "plan.autocast() and plan.backward(), not a per-module one. Keep modules in "
                "fp32 under an autocast or bf16 mode, or train in fp32."
            )
        if self.fp8_skip and not self.mode.startswith("fp8"):
            raise ValueError(f"fp8_skip applies only to the FP8 modes, not {self.mode!r}.")
        if self.fp8_layers is not None and self.mode != "fp8_torchao":
            raise ValueError(f"fp8_layers applies only to 'fp8_torchao', not {self.mode!r}.")
        if self.te_delayed_scaling is not None and not (self.fp8_recipe or "").startswith(
            "te_delayed"
        ):
            raise ValueError("te_delayed_scaling applies only to the te_delayed_* recipes.")
        return self

    @property
    def label(self) -> str:
        """Short human-readable name, e.g. ``amp_bf16+8bit-optim``."""
        parts = [self.mode]
        if self.fp8_recipe:
            parts.append(self.fp8_recipe.split("_", 1)[1])
        if self.emulate:
            parts.append("emulated")
        if self.optimizer_bits == 8:
            parts.append("8bit-optim")
        if self.compile:
            parts.append("compiled")
        return "+".join(parts)


def matches_keep_fp32(fqn: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """True when module ``fqn`` or one of its ancestors matches a ``keep_fp32`` pattern: its
    exact name or an ``fnmatch`` pattern such as ``blocks.*.ln_*``. A pattern naming a
    container keeps everything inside it, a glob as much as an exact name (``blocks.*.mlp``
    kept ``blocks.0.mlp``'s Linears in FP8 while ``blocks.0.mlp`` kept them out)."""
    parts = fqn.split(".")
    names = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
    return any(
        name == pattern or fnmatch.fnmatchcase(name, pattern)
        for pattern in patterns
        for name in names
    )
