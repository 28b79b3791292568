"""fp8_te: Transformer Engine FP8 Linears under ``te.autocast`` and bf16 autocast.

Needs a CUDA GPU with compute capability >= 8.9 and ``transformer_engine`` (2.x names
``te.autocast``; 1.x ``fp8_autocast`` is used when that is what is installed). The recipe is
stored in full in the profile: delayed scaling (HYBRID or E4M3, with amax history length,
algorithm and margin), current scaling, or MXFP8 (compute capability 10.x or 11.x, where TE
runs it; Linears whose dimensions divide by 32).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from autoprec._imports import require
from autoprec.eligibility import Situation, mxfp8_reason
from autoprec.layer_kinds import MXFP8_BLOCK, fp8_linear_fits
from autoprec.modes.base import PrecisionMode, override, swaps_under_every_name
from autoprec.modes.islands import install_fp32_islands
from autoprec.random_streams import cuda_devices_of, kept_streams
from autoprec.specs import TeDelayedScaling


class Fp8TeMode(PrecisionMode):
    name = "fp8_te"

    @override
    def requirements(self, situation: Situation) -> list[str]:
        reasons = super().requirements(situation)
        if self.spec.fp8_recipe == "te_mxfp8":
            reason = mxfp8_reason(situation.gpu)
            if reason is not None:
                reasons.append(reason)
        return reasons

    @override
    def module_filter_fn(self, module: nn.Module, fqn: str) -> bool:
        kept = self.keeps_fp32(fqn) or self.skips_fp8(fqn) or id(module) in self.kept_out_of_fp8
        if not fp8_linear_fits(module) or kept:
            return False
        if self.spec.fp8_recipe == "te_mxfp8":
            return module.in_features % MXFP8_BLOCK == 0 and module.out_features % MXFP8_BLOCK == 0
        return True

    def te_recipe(self) -> Any:
        """The Transformer Engine recipe object this spec describes, field by field."""
        recipe = require("transformer_engine").common.recipe
        name = self.spec.fp8_recipe
        if name in ("te_delayed_hybrid", "te_delayed_e4m3"):
            delayed = self.spec.te_delayed_scaling or TeDelayedScaling()
            fp8_format = recipe.Format.HYBRID if name == "te_delayed_hybrid" else recipe.Format.E4M3
            return recipe.DelayedScaling(
                fp8_format=fp8_format,
                amax_history_len=delayed.amax_history_len,
                amax_compute_algo=delayed.amax_compute_algo,
                margin=delayed.margin,
            )
        if name == "te_current":
            return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
        if name == "te_mxfp8":
            return recipe.MXFP8BlockScaling()
        raise ValueError(f"fp8_te cannot run recipe {name!r}.")

    @override
    def convert_module(self, model: nn.Module) -> nn.Module:
        model = super().convert_module(model)
        te = require("transformer_engine").pytorch
        self.read_out_of_fp8(model)
        self.converted: list[str] = []
        with swaps_under_every_name(model):
            self._swap_linears(model, te)
        install_fp32_islands(model, self.kept_roots(model), self.device_type)
        return model

    def _swap_linears(self, model: nn.Module, te: Any) -> None:
        """Replace each Linear the filter takes by a te.Linear holding its Parameters."""
        for fqn, module in list(model.named_modules()):
            if not fqn or not self.module_filter_fn(module, fqn):
                continue
            parent_name, _, child_name = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            # te.Linear initialises weights it is about to lose (normal_ on the CUDA stream):
            # drawn outside the trial's seeded streams, or dropout would not match fp32's
            with kept_streams(cuda_devices_of(module.weight.device)):
                replacement = te.Linear(
                    module.in_features,
                    module.out_features,
                    bias=module.bias is not None,
                    params_dtype=module.weight.dtype,
                    device=module.weight.device,
                )
            # the same Parameter objects, not copies: a tied weight stays tied and the
            # optimizer already holds them (te.Linear reads self.weight / self.bias per call)
            replacement.weight = module.weight
            if module.bias is not None:
                replacement.bias = module.bias
            setattr(parent, child_name, replacement)
            self.converted.append(fqn)

    @override
    def fp8_modules(self, model: nn.Module) -> tuple[str, ...]:
        return tuple(getattr(self, "converted", ()))

    @override
    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        te = require("transformer_engine").pytorch
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.device_type, dtype=torch.bfloat16))
        if hasattr(te, "autocast"):  # Transformer Engine 2.x
            stack.enter_context(te.autocast(enabled=True, recipe=self.te_recipe()))
        else:  # pragma: no cover - Transformer Engine 1.x
            stack.enter_context(te.fp8_autocast(enabled=True, fp8_recipe=self.te_recipe()))
        return stack
