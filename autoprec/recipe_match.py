"""How the recipe a profile is applied under differs from the one its evidence was measured
under: the optimizer's class, its groups' hyper-parameters, accumulation and clipping.

A verdict holds for the recipe it was measured under: pure bf16 that kept its updates at lr 3e-3
can lose most of them at 3e-5, and an fp16 scaler settles differently with another accumulation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from autoprec.recipe import RecipeSummary, plain_value, qualified_name

IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Group options that choose a kernel, not the update: ignored when comparing recipes."""


def recipe_differences(
    recipe: RecipeSummary,
    optimizer: torch.optim.Optimizer,
    *,
    grad_accumulation_steps: int,
    clip_grad_norm: float | None,
) -> list[str]:
    """Each way ``optimizer`` and the step settings differ from ``recipe``, as short phrases."""
    differences = []
    applied = qualified_name(type(optimizer)) or type(optimizer).__name__
    if applied != recipe.optimizer:
        differences.append(f"optimizer: proven with {recipe.optimizer}, applied with {applied}")
    else:
        differences += _group_differences(recipe.optimizer_groups, optimizer.param_groups)
    if grad_accumulation_steps != recipe.grad_accumulation_steps:
        differences.append(
            f"grad_accumulation_steps: proven at {recipe.grad_accumulation_steps}, "
            f"applied with {grad_accumulation_steps}"
        )
    if clip_grad_norm != recipe.clip_grad_norm:
        differences.append(
            f"clip_grad_norm: proven at {recipe.clip_grad_norm}, applied with {clip_grad_norm}"
        )
    return differences


def _group_differences(
    proven: tuple[dict[str, Any], ...], applied: list[dict[str, Any]]
) -> list[str]:
    if len(proven) != len(applied):
        return [f"parameter groups: proven with {len(proven)}, applied with {len(applied)}"]
    differences = []
    for index, (recorded, group) in enumerate(zip(proven, applied, strict=True)):
        for key, value in recorded.items():
            if key in IMPLEMENTATION_FLAGS or key not in group:
                continue
            candidates = [group[key]]
            if key == "lr" and "initial_lr" in group:  # a scheduler built before apply()
                candidates.append(group["initial_lr"])
            if not any(_same(value, plain_value(c)) for c in candidates):
                where = f"group {index} " if len(proven) > 1 else ""
                differences.append(
                    f"{where}{key}: proven at {_shown(value)}, "
                    f"applied with {_shown(plain_value(candidates[-1]))}"
                )
    return differences


def _same(proven: Any, applied: Any) -> bool:
    if isinstance(proven, list) and isinstance(applied, list):
        return len(proven) == len(applied) and all(map(_same, proven, applied))
    if isinstance(proven, bool) or isinstance(applied, bool):
        return proven == applied
    if isinstance(proven, int | float) and isinstance(applied, int | float):
        return math.isclose(proven, applied, rel_tol=1e-6, abs_tol=0.0)
    return proven == applied


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "(" + ", ".join(_shown(v) for v in value) + ")"
    return str(value)
