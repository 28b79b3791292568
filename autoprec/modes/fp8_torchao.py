"""fp8_torchao: torchao float8 training (tensorwise or rowwise scaling) under bf16 autocast.

nn.Linear layers whose dimensions FP8 kernels take (both divisible by 16), that are not in
``keep_fp32`` and (``fp8_layers="worthwhile"``, the default) large enough for FP8 to pay by
torchao's own size rule become ``Float8Linear``; everything else runs in bf16 autocast with
fp32 master weights, and ``keep_fp32`` modules in fp32. ``emulate=True`` runs the same FP8 numerics
without FP8 hardware: a quality screen, never a speed figure.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from autoprec._imports import require
from autoprec._wording import first_names
from autoprec.eligibility import Situation
from autoprec.layer_kinds import fp8_linear_fits, fp8_worthwhile
from autoprec.modes.base import PrecisionMode, override, swaps_under_every_name
from autoprec.modes.islands import install_fp32_islands

_TORCHAO_RECIPES = {"torchao_tensorwise": "tensorwise", "torchao_rowwise": "rowwise"}
_RULES = {
    "tensorwise": ": it skips in_features <= 4096 with out_features <= 1024",
    "rowwise": ": it skips out_features <= 2048, in_features <= 1024, or both <= 4096 and 2048",
}
"""torchao's own size rule (``layer_kinds.fp8_worthwhile``), as a refusal words it."""


class Fp8TorchaoMode(PrecisionMode):
    name = "fp8_torchao"

    @override
    def requirements(self, situation: Situation) -> list[str]:
        return super().requirements(dataclasses.replace(situation, emulate_fp8=self.spec.emulate))

    @override
    def module_filter_fn(self, module: nn.Module, fqn: str) -> bool:
        # torchao on CPU does not enforce the multiple-of-16 rule; autoprec does. The root
        # cannot be swapped in place (torchao returns a new module for a root Linear).
        if not fqn or not fp8_linear_fits(module) or self.keeps_fp32(fqn) or self.skips_fp8(fqn):
            return False
        if id(module) in self.kept_out_of_fp8:  # kept under another of its names
            return False
        if self.spec.fp8_layers == "all":
            return True
        recipe = _TORCHAO_RECIPES[self.spec.fp8_recipe or "torchao_tensorwise"]
        assert isinstance(module, nn.Linear)
        return fp8_worthwhile(module.in_features, module.out_features, recipe)

    @override
    def fp8_modules(self, model: nn.Module) -> tuple[str, ...]:
        return tuple(fqn for fqn, m in model.named_modules() if type(m).__name__ == "Float8Linear")

    def float8_config(self) -> object:
        float8 = require("torchao").float8
        recipe = _TORCHAO_RECIPES[self.spec.fp8_recipe or "torchao_tensorwise"]
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        return dataclasses.replace(config, emulate=self.spec.emulate)

    @override
    def convert_module(self, model: nn.Module) -> nn.Module:
        model = super().convert_module(model)
        self.read_out_of_fp8(model)
        if not any(self.module_filter_fn(m, fqn) for fqn, m in model.named_modules()):
            too_small = self._fitting_but_too_small(model)
            if too_small:
                recipe = _TORCHAO_RECIPES[self.spec.fp8_recipe or "torchao_tensorwise"]
                raise ValueError(
                    f"{self.spec.label} would run no layer of {type(model).__name__} in FP8: its "
                    f"Linears that fit FP8 kernels ({first_names(too_small)}) are all too "
                    f"small for FP8 to pay by torchao's size rule for its {recipe} recipe "
                    f"(fp8_layers='worthwhile', the default{_RULES[recipe]}). fp8_layers='all' "
                    "converts them, to screen FP8's quality (autoprec check does); for speed use "
                    "amp_bf16."
                )
            raise ValueError(
                f"{self.spec.label} would run no layer of {type(model).__name__} in FP8: no "
                "Linear below the model's root fits FP8 kernels (both dimensions divisible by "
                f"16, a plain nn.Linear) outside keep_fp32 {list(self.spec.keep_fp32)} and "
                f"fp8_skip {list(self.spec.fp8_skip)}. It would train as amp_bf16 under an FP8 "
                "label: use amp_bf16."
            )
        float8 = require("torchao").float8
        with swaps_under_every_name(model):
            float8.convert_to_float8_training(  # the filter leaves keep_fp32 and fp8_skip out
                model, config=self.float8_config(), module_filter_fn=self.module_filter_fn
            )
        install_fp32_islands(model, self.kept_roots(model), self.device_type)
        return model

    def _fitting_but_too_small(self, model: nn.Module) -> list[str]:
        """The Linears ``fp8_layers="all"`` would convert, when the size rule leaves out all."""
        everything = type(self)(self.spec.model_copy(update={"fp8_layers": "all"}))
        everything.read_out_of_fp8(model)  # a Linear kept under its second name is no answer
        return [fqn for fqn, m in model.named_modules() if everything.module_filter_fn(m, fqn)]

    @override
    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        return torch.autocast(self.device_type, dtype=torch.bfloat16)
