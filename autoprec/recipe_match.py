"""How the recipe a profile is applied under differs from the one its evidence was measured
under: the optimizer's class, its groups' hyper-parameters, the learning rates (and momenta)
the schedule reaches, accumulation and clipping.

A verdict holds for the recipe it was measured under: pure bf16 that kept its updates at lr 3e-3
can lose most of them at 3e-5, and an fp16 scaler settles differently with another accumulation.
"""

from __future__ import annotations

import collections
import copy
import math
from typing import Any

import torch

from autoprec.recipe import (
    LrPoint,
    RecipeSummary,
    plain_value,
    qualified_name,
    schedule_points,
    step_schedule,
)

IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Group options that choose a kernel, not the update: ignored when comparing recipes."""


def recipe_differences(
    recipe: RecipeSummary,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    grad_accumulation_steps: int,
    clip_grad_norm: float | None,
    total_steps: int | None = None,
) -> list[str]:
    """Each way ``optimizer`` (driven by ``scheduler``, if given, over ``total_steps``: the
    proven run's when None) and the step settings differ from ``recipe``, as short phrases."""
    differences = []
    applied = qualified_name(type(optimizer)) or type(optimizer).__name__
    if applied != recipe.optimizer:
        differences.append(f"optimizer: proven with {recipe.optimizer}, applied with {applied}")
    else:
        # what the schedule sets is compared as its lr points: the lr under a scheduler, the
        # momentum (beta1) when the proven schedule cycled it
        cycled = any(point.momenta is not None for point in recipe.lr_points)
        scheduled = set()
        groups = optimizer.param_groups
        unscheduled = scheduler is None and _schedule_dropped(recipe, groups)
        if scheduler is not None or unscheduled:
            scheduled = {"lr", "momentum", "beta1"} if cycled else {"lr"}
        differences += _group_differences(recipe.optimizer_groups, groups, scheduled)
        if scheduler is not None:
            differences += _schedule_differences(recipe, optimizer, scheduler, total_steps)
        elif unscheduled:
            shown = "; ".join(point.describe() for point in recipe.lr_points)
            differences.append(
                f"schedule: proven with {recipe.scheduler} ({shown}), applied without one "
                "(pass your scheduler to apply() to compare its lr)"
            )
    if grad_accumulation_steps != recipe.grad_accumulation_steps:
        differences.append(
            f"grad_accumulation_steps: proven at {recipe.grad_accumulation_steps}, "
            f"applied with {grad_accumulation_steps}"
        )
    # None and inf both mean no clipping (inf measures the norm only), as plan.step reads
    # them (found by a hunt: strict=True refused a profile proven at inf, applied with None)
    if _as_limit(clip_grad_norm) != _as_limit(recipe.clip_grad_norm):
        differences.append(
            f"clip_grad_norm: proven at {_clipping(recipe.clip_grad_norm)}, applied with "
            f"{_clipping(clip_grad_norm)}"
        )
    return differences


def _schedule_dropped(recipe: RecipeSummary, groups: list[dict[str, Any]]) -> bool:
    """The recipe was proven under a scheduler, and none was passed nor built on this optimizer
    (no group has an ``initial_lr``): the run trains at a constant lr. Its constructor lr was
    compared with the proven constructor lr, which a OneCycleLR run never trains at: a run
    100x above the proven peak passed, one exactly at it was warned about (found by a hunt)."""
    return recipe.scheduler is not None and not any("initial_lr" in g for g in groups)


def _as_limit(norm: float | None) -> float:
    return math.inf if norm is None else norm


def _clipping(norm: float | None) -> str:
    return "None (no clipping)" if norm is None else str(norm)


def _group_differences(
    proven: tuple[dict[str, Any], ...], applied: list[dict[str, Any]], scheduled: set[str]
) -> list[str]:
    """Group options that differ, leaving out kernel flags and the ``scheduled`` ones (with
    ``beta1`` scheduled, ``betas`` is compared from its second element on)."""
    if len(proven) != len(applied):
        return [f"parameter groups: proven with {len(proven)}, applied with {len(applied)}"]
    differences = []
    for index, (recorded, group) in enumerate(zip(proven, applied, strict=True)):
        for key, value in recorded.items():
            if key in IMPLEMENTATION_FLAGS or key in scheduled or key not in group:
                continue
            candidates = [plain_value(group[key])]
            if key == "lr" and "initial_lr" in group:  # a scheduler built before apply()
                candidates.append(plain_value(group["initial_lr"]))
            if key == "betas" and "beta1" in scheduled:
                value, candidates = value[1:], [c[1:] for c in candidates]
            if not any(_same(value, c) for c in candidates):
                where = f"group {index} " if len(proven) > 1 else ""
                differences.append(
                    f"{where}{key}: proven at {_shown(value)}, "
                    f"applied with {_shown(candidates[-1])}"
                )
    return differences


def _schedule_differences(
    recipe: RecipeSummary,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    total_steps: int | None = None,
) -> list[str]:
    """Step a copy of the scheduler (and its optimizer, parameters shared) through the rest of
    the run (``total_steps``: the applied run's length, the proven one's when None) and compare
    the lr points it reaches with the proven ones still ahead of it. A run of another length is
    said: only its first proven-length steps were stepped before, and a 10x longer run ending
    near lr 0 passed unnamed (found by a hunt)."""
    proven = recipe.lr_points
    shown = "; ".join(point.describe() for point in proven)
    if recipe.scheduler is None or recipe.total_steps is None:
        return [f"schedule: proven without one ({shown}), applied with {type(scheduler).__name__}"]
    length = recipe.total_steps if total_steps is None else total_steps
    found = (
        [f"total_steps: proven over {recipe.total_steps}, applied over {length}"]
        if length != recipe.total_steps
        else []
    )
    position = _schedule_position(scheduler)
    if position >= length:
        return [
            *found,
            f"schedule: the applied {type(scheduler).__name__} is at step {position}, past the "
            f"{'proven ' if total_steps is None else ''}run's {length} steps",
        ]
    # shared, not copied: the parameters, and the optimizer's state (a schedule reads only the
    # groups; a mid-run switch's Adam moments would double on their device)
    shared: dict[int, Any] = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    shared[id(optimizer.state)] = collections.defaultdict(dict)
    try:
        optimizer_copy, scheduler_copy = copy.deepcopy((optimizer, scheduler), shared)
        lrs, momenta = step_schedule(optimizer_copy, scheduler_copy, length - position)
        if position == 0:  # momenta as the proven points carry them (a constant one included)
            carried = any(point.momenta is not None for point in proven)
            varying = momenta if carried or any(m != momenta[0] for m in momenta) else None
            applied = schedule_points(lrs, varying, length)  # type: ignore[arg-type]
            differs = not _same_points(proven, applied)
            if differs and _read_earlier(proven, lrs, varying, length):
                return found  # a profile whose floor the rule before 2026-11-29 read (a review)
            if differs and (varying is None or carried):
                # a profile whose floor an earlier rule chose (step 179 of 200, today's 180):
                # the same schedule sets the proven lrs at the proven steps (found by a hunt:
                # every profile written before 2026-11-28 warned of its own schedule); not a
                # schedule cycling a momentum the proven one left alone (found by a review)
                ahead = _points_ahead(proven, 0, lrs, momenta)
                if (
                    len(ahead[0]) == len(proven)
                    and _same_points(*ahead)
                    and _legs_near(proven, applied)
                ):
                    return found
        else:  # a run resumed or switched mid-way: the points it has passed are history
            proven, applied = _points_ahead(proven, position, lrs, momenta)
    except Exception as error:  # noqa: BLE001 - a scheduler that cannot be read apart
        return [
            *found,
            f"learning rates: proven at {shown}; the applied {type(scheduler).__name__} could "
            f"not be stepped on a copy ({type(error).__name__}: {error}), so whether it reaches "
            "them is unknown",
        ]
    if _same_points(proven, applied):
        return found
    reached = "; ".join(point.describe() for point in applied)
    return [*found, f"learning rates: proven at {shown}; the applied schedule reaches {reached}"]


def _read_earlier(
    proven: tuple[LrPoint, ...],
    lrs: list[tuple[float, ...]],
    momenta: list[tuple[float, ...]] | None,
    length: int,
) -> bool:
    """Whether the rule before 2026-11-29, which read a floor in a warm-up, reads ``proven``
    from the applied schedule: a profile it wrote matches its own schedule."""
    return _same_points(proven, schedule_points(lrs, momenta, length, floor_in_decay=False))


def _schedule_position(scheduler: Any) -> int:
    """How many steps ``scheduler`` has already taken: an LRScheduler's ``last_epoch``; a
    ChainedScheduler, which keeps none, its schedulers' (they all step with it); 0 for one
    that does not say."""
    position = getattr(scheduler, "last_epoch", None)
    if position is None:
        inner = getattr(scheduler, "_schedulers", None) or []
        return max((_schedule_position(each) for each in inner), default=0)
    return position if isinstance(position, int) and position > 0 else 0


def _points_ahead(
    proven: tuple[LrPoint, ...],
    position: int,
    lrs: list[tuple[float, ...]],
    momenta: list[tuple[float, ...] | None],
) -> tuple[tuple[LrPoint, ...], tuple[LrPoint, ...]]:
    """The proven points at or after ``position``, and what the applied schedule (stepped from
    ``position`` into ``lrs``/``momenta``) sets at each of their steps."""
    ahead, applied = [], []
    for point in proven:
        if point.schedule_step is None or point.schedule_step < position:
            continue
        index = point.schedule_step - position
        if index >= len(lrs):  # a shorter run never reaches it (its length is said apart)
            continue
        momentum = None if point.momenta is None else momenta[index]
        ahead.append(point)
        applied.append(point.model_copy(update={"lrs": lrs[index], "momenta": momentum}))
    return tuple(ahead), tuple(applied)


def _legs_near(proven: tuple[LrPoint, ...], applied: tuple[LrPoint, ...]) -> bool:
    """The applied schedule's own legs at the proven legs' lrs within a factor of
    ``LEG_LR_FACTOR``: what lets a profile whose floor an earlier rule read elsewhere match its
    own schedule, and not a schedule that only passes the same lrs there. A floor read at a
    warm-up step (before 2026-11-29) matched OneCycleLR's three phases, whose floor is 7x
    lower, at that warm-up step (found by a hunt)."""
    if [point.role for point in proven] != [point.role for point in applied]:
        return False
    return all(
        all(
            (a == b == 0) or (a > 0 and b > 0 and max(a, b) / min(a, b) <= LEG_LR_FACTOR)
            for a, b in zip(mine.lrs, theirs.lrs, strict=True)
        )
        for mine, theirs in zip(proven, applied, strict=True)
    )


LEG_LR_FACTOR = 1.5
"""How far an old profile's legs may sit from its own schedule's legs as read today: the floor
rule's changes moved a cosine's floor one step (179 to 180 of 200, its lr 9% apart) and a
OneCycleLR's from a warm-up step to the decay's (2% apart); a changed schedule moves it by
factors (7x, 50x)."""


def _same_points(proven: tuple[LrPoint, ...], applied: tuple[LrPoint, ...]) -> bool:
    return len(proven) == len(applied) and all(
        _same(list(a.lrs), list(b.lrs))
        and (a.momenta is None) == (b.momenta is None)
        and (a.momenta is None or _same(list(a.momenta), list(b.momenta or ())))
        for a, b in zip(proven, applied, strict=True)
    )


_JSON_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
"""How a profile file writes non-finite floats (``ser_json_inf_nan="strings"``): a group
option read back from a file (Prodigy's ``growth_rate=inf``) is such a string."""


def _same(proven: Any, applied: Any) -> bool:
    if isinstance(proven, list) and isinstance(applied, list):
        return len(proven) == len(applied) and all(map(_same, proven, applied))
    if isinstance(proven, str) and proven in _JSON_FLOATS:
        proven = _JSON_FLOATS[proven]  # inf read back from a file was "Infinity" vs inf
    if isinstance(proven, bool) or isinstance(applied, bool):
        return proven == applied
    if isinstance(proven, int | float) and isinstance(applied, int | float):
        if math.isnan(proven) or math.isnan(applied):
            return math.isnan(proven) and math.isnan(applied)
        return math.isclose(proven, applied, rel_tol=1e-6, abs_tol=0.0)
    return proven == applied


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "(" + ", ".join(_shown(v) for v in value) + ")"
    return str(value)
