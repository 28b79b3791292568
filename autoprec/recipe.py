"""The user's training recipe: one frozen value that trials run, the gate judges under, the
study fingerprints and the profile records.

A verdict holds only for the run it was measured under. The recipe says what that run is: the
optimizer (an optimizer over the model, cloned per trial, or a factory ``params -> optimizer``),
the LR schedule (a factory ``optimizer -> LRScheduler``) over the real run's ``total_steps``,
gradient accumulation, clipping, and how a batch becomes a loss (``loss_fn`` / ``train_step``).

Trials do not replay thousands of scheduler steps. :func:`lr_points` reads the schedule once
and picks the learning rates that decide a verdict: the peak, and the floor the run spends its
last stretch at (``FLOOR_QUANTILE``), where pure bf16 loses the most updates. A trial trains
one leg at each, in that order (``benchmarks/lr_schedule_gate.py`` measured this against long
runs; see the README).
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, Field, model_validator
from torch import nn

from autoprec._models import FROZEN_RECORD
from autoprec.batching import LossFn, TrainStep
from autoprec.optim import named_groups, rebuild_optimizer
from autoprec.plan import check_step_settings, refuse_closure_optimizer

OptimizerSource = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer]
"""An optimizer over the user's model (cloned per trial) or a factory ``params -> optimizer``."""
SchedulerFactory = Callable[..., Any]
"""``factory(optimizer) -> LRScheduler``; called as ``factory(optimizer, total_steps=N)`` when
it takes a ``total_steps`` argument, as ``factory(optimizer, N)`` when it is a function whose
second argument, under another name, has no default."""

DEFAULT_LR = 3e-4
"""Learning rate of the default optimizer, AdamW(lr=3e-4), when none is given."""

FLOOR_QUANTILE = 0.1
"""The floor leg trains at the learning rate that the real run's last 10% of (non-zero-lr) optimizer
steps stay at or below: the 10th percentile of the schedule's lr over its steps. A cosine decay
from 1e-3 to 1e-5 over 3000 steps gives 3.4e-5, its lr at step 2700. Lower quantiles pick lrs the
run spends too few steps at to matter (a linear decay to 0 would be judged at ~0); higher ones
miss the end of the decay, where pure bf16 loses its updates (measured in
benchmarks/lr_schedule_gate.py)."""
SEPARATE_FLOOR_BELOW = 0.5
"""A floor leg is trained only when the floor lr is below half the peak; otherwise one leg."""


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW(lr=3e-4): the optimizer trials use when none is given."""
    return torch.optim.AdamW(params, lr=DEFAULT_LR)


USER_MODULE_PREFIX = "_autoprec_user_"
"""Name prefix of the modules the CLI loads from ``file.py:factory`` (autoprec.factories)."""


def qualified_name(value: Any) -> str | None:
    """``module:qualname`` of a function, class or partial (None for None); for a function
    from a ``file.py`` the CLI loaded, the file's path in place of its module's made-up name."""
    if value is None:
        return None
    target = getattr(value, "func", value)  # functools.partial
    module = getattr(target, "__module__", None) or type(target).__module__
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    if module.startswith(USER_MODULE_PREFIX):
        module = getattr(sys.modules.get(module), "__file__", None) or module
    return f"{module}:{qualname}"


def refuse_wrong_arity(name: str, function: Callable[..., Any], form: str, arguments: int) -> None:
    """Refuse ``function`` (the user's ``name``, called as ``form``) when it cannot be called
    with ``arguments`` positional arguments: found here, with its signature, rather than as a
    TypeError inside the first training step. Callables without a readable signature (C
    functions) pass."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*([None] * arguments))
    except TypeError as error:
        shown = qualified_name(function) or type(function).__name__
        raise TypeError(
            f"{name} is called as {form}, but {shown}{signature} cannot take that "
            f"({error}). Change its parameters to fit."
        ) from None


def group_momenta(optimizer: torch.optim.Optimizer) -> tuple[float, ...] | None:
    """Each group's momentum: β1 (``betas[0]``, or torch-optimi's ``beta1``) or SGD's
    ``momentum``; None when a group has neither."""
    values = []
    for group in optimizer.param_groups:
        if "betas" in group:
            values.append(float(group["betas"][0]))
        elif "beta1" in group:
            values.append(float(group["beta1"]))
        elif "momentum" in group:
            values.append(float(group["momentum"]))
        else:
            return None
    return tuple(values)


def set_group_momentum(group: dict[str, Any], value: float) -> None:
    """Set one group's momentum where ``group_momenta`` reads it."""
    if "betas" in group:
        group["betas"] = (value, *tuple(group["betas"])[1:])
    elif "beta1" in group:
        group["beta1"] = value
    elif "momentum" in group:
        group["momentum"] = value
    else:
        raise ValueError(
            f"The schedule sets a momentum, but this optimizer group has no betas, beta1 or "
            f"momentum to set (it has {sorted(k for k in group if k != 'params')})."
        )


class LrPoint(BaseModel):
    """The learning rates of one trial leg (one per parameter group) and where they come from."""

    model_config = FROZEN_RECORD

    role: Literal["constant", "peak", "floor", "replay"]
    """constant: no schedule; peak / floor: the legs tune() trains; replay: benchmarks only."""
    lrs: tuple[Annotated[float, Field(ge=0, allow_inf_nan=False)], ...] = Field(min_length=1)
    momenta: tuple[float, ...] | None = Field(None, min_length=1)
    """Each group's momentum at that step (β1 of Adam-family optimizers, ``momentum`` of SGD)
    when the schedule sets it (OneCycleLR and CyclicLR cycle it against the lr); None: the
    optimizer's own. One per group, as ``lrs``: a profile's ``[]`` loaded and then failed
    with a bare IndexError (found by a hunt)."""
    schedule_step: int | None = None
    """The real run's optimizer step these lrs are taken from (None without a schedule)."""
    total_steps: int | None = None

    @model_validator(mode="after")
    def _one_momentum_a_group(self) -> LrPoint:
        if self.momenta is not None and len(self.momenta) != len(self.lrs):
            raise ValueError(
                f"momenta holds {len(self.momenta)} values for {len(self.lrs)} groups' lrs: "
                "one per group"
            )
        return self

    @property
    def lr(self) -> float:
        """The first group's lr (what messages quote)."""
        return self.lrs[0]

    def describe(self, group: int | None = None) -> str:
        """This leg's lr of one parameter group, or of every group by default (one per group,
        "lrs 0.0001 / 3.45e-05": group 0's alone read as equal legs and equal schedules where
        a head's floor differed beside a constant backbone; found by a hunt), and where it is
        from."""
        where = (
            ""
            if self.schedule_step is None
            else f", the schedule's {self.role} at step {self.schedule_step} of {self.total_steps}"
        )
        groups = range(len(self.lrs)) if group is None else [group]
        lrs = " / ".join(f"{self.lrs[index]:.3g}" for index in groups)
        momentum = ""
        if self.momenta is not None:
            momenta = " / ".join(f"{self.momenta[index]:.3g}" for index in groups)
            momentum = f" (momentum/β1 {momenta})"
        return f"{'lrs' if len(groups) > 1 else 'lr'} {lrs}{momentum}{where}"


class RecipeSummary(BaseModel):
    """The recipe as data: what a profile records and a study fingerprints."""

    model_config = FROZEN_RECORD

    optimizer: str
    """Class of the optimizer trials train with, e.g. ``torch.optim.adamw:AdamW``."""
    optimizer_groups: tuple[dict[str, Any], ...]
    """Each group's hyper-parameters (lr, betas, eps, weight_decay, ...), parameters left out."""
    scheduler: str | None = None
    total_steps: int | None = Field(None, ge=1)
    grad_accumulation_steps: int = Field(1, ge=1)
    clip_grad_norm: float | None = Field(None, gt=0)
    """None: no clipping; inf: the norm measured, nothing clipped (NaN is refused)."""
    loss_fn: str | None = None
    train_step: str | None = None
    lr_points: tuple[LrPoint, ...] = ()
    optimizer_state_steps: int | None = None
    """None: trials started from fresh optimizer state. Else they started from the state of the
    optimizer passed (a run's checkpoint), whose parameters had taken up to this many steps (0
    for state that counts none, such as SGD's momentum)."""


def plain_value(value: Any) -> Any:
    """A hyper-parameter as JSON data: tensors as numbers or lists, other objects as repr."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple | list):
        return [plain_value(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return repr(value)


def step_schedule(
    optimizer: torch.optim.Optimizer, scheduler: Any, steps: int
) -> tuple[list[tuple[float, ...]], list[tuple[float, ...] | None]]:
    """Each group's lr and momentum (``group_momenta``) at each of ``steps`` optimizer steps,
    stepping ``scheduler`` (which drives ``optimizer``; None: one entry, the optimizer's own)."""
    lrs = [tuple(float(g["lr"]) for g in optimizer.param_groups)]
    momenta = [group_momenta(optimizer)]
    with warnings.catch_warnings():  # stepping a scheduler without optimizer.step()
        warnings.simplefilter("ignore")
        for _ in range(steps - 1 if scheduler is not None else 0):
            scheduler.step()
            lrs.append(tuple(float(g["lr"]) for g in optimizer.param_groups))
            momenta.append(group_momenta(optimizer))
    return lrs, momenta


def _floor_step(picked: int, peak: int, moving: list[int], lowest: dict[int, float]) -> int:
    """Where the floor leg is read: ``picked`` (the step at the floor's rank), or, when that
    step is in the warm-up before the peak and the decay after it comes down that far, the
    decay's first step at or below its lr. A warm-up passes the floor's lr on its way up:
    HF's warm-up + linear decay at step 9 (1e-4, again at step 1810 of 2000), OneCycleLR at
    step 4 of 600. The floor then read "at step 9", with the warm-up's momentum, and apply()
    compared a schedule at those warm-up steps, letting a decay 50x steeper (or OneCycleLR's
    three phases, 7x lower) through without a warning (found by two hunts)."""
    if picked > peak:
        return picked
    target = lowest[picked] * (1 + 1e-9)
    decay = [step for step in moving if step > peak and lowest[step] <= target]
    return decay[0] if decay else picked


def schedule_points(
    lrs: list[tuple[float, ...]],
    momenta: list[tuple[float, ...]] | None,
    total_steps: int,
    floor_quantile: float = FLOOR_QUANTILE,
    *,
    floor_in_decay: bool = True,
) -> tuple[LrPoint, ...]:
    """The peak and, when it is below ``SEPARATE_FLOOR_BELOW`` of the peak, the floor
    (``floor_quantile`` of the steps with lr > 0) of a schedule read step by step.

    Every parameter group counts, each against its own peak: a head warmed up and decayed
    beside a constant backbone is judged at the head's peak and floor (before, group 0 alone
    was read, and the head trained at its warm-up's lr 0 in every trial)."""
    peaks = [max(values[group] for values in lrs) for group in range(len(lrs[0]))]
    groups = [group for group, peak in enumerate(peaks) if peak > 0]
    moving = [step for step in range(len(lrs)) if any(lrs[step][g] > 0 for g in groups)]
    if not moving:
        raise ValueError(
            f"The schedule keeps the learning rate at 0 for all {total_steps} steps: "
            "the run would never move, so there is nothing to judge a precision by."
        )

    def relative(step: int) -> list[float]:  # each moving group's lr against its own peak
        return [lrs[step][g] / peaks[g] for g in groups if lrs[step][g] > 0]

    lowest = {step: min(relative(step)) for step in moving}
    peak = max(moving, key=lambda step: (sum(relative(step)), -step))  # all groups highest
    ranked = sorted(moving, key=lambda step: (lowest[step], -step))
    # nearest rank: the lowest lr that at least floor_quantile of the steps stay at or below
    # (rounded first: 0.55 x 100 is 55.00000000000001 in floats). floor(q x n) took one step
    # more, so a step schedule whose lowest lr lasted exactly its last 10% was judged a step
    # earlier, at 10x that lr, or on its peak leg alone.
    rank = max(1, math.ceil(round(floor_quantile * len(ranked), 9)))
    floor = ranked[rank - 1]
    if floor_in_decay:  # False: the rule before 2026-11-29, to match profiles it wrote
        floor = _floor_step(floor, peak, moving, lowest)

    def point(role: Literal["peak", "floor"], step: int) -> LrPoint:
        return LrPoint(
            role=role,
            lrs=lrs[step],
            momenta=None if momenta is None else momenta[step],
            schedule_step=step,
            total_steps=total_steps,
        )

    points = [point("peak", peak)]
    if lowest[floor] < SEPARATE_FLOOR_BELOW * lowest[peak]:
        points.append(point("floor", floor))
    return tuple(points)


_PINNED_GROUPS = ("optimizer_groups", 0)
"""The ``TrainingRecipe._cache`` key of the optimizer's groups named by ``name_groups_after``."""


def _group_values(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every group's settings (a tensor's a copy), to put back with :func:`_put_group_values`."""
    return [
        {key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in group.items()}
        for group in optimizer.param_groups
    ]


def _put_group_values(optimizer: torch.optim.Optimizer, values: list[dict[str, Any]]) -> None:
    """The groups as :func:`_group_values` found them (a tensor lr refilled in place)."""
    for group, saved in zip(optimizer.param_groups, values, strict=True):
        for key in set(group) - set(saved):
            del group[key]
        for key, value in saved.items():
            if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                group[key].copy_(value)
            else:
                group[key] = value


@dataclass(frozen=True)
class TrainingRecipe:
    """How the user trains: what every trial runs and ``apply()`` reproduces.

    Args:
        optimizer: an optimizer over the model (its groups and hyper-parameters are cloned per
            trial, and its state when it has stepped: a run's checkpoint starts every trial
            with its own Adam moments or momentum; the object itself is never stepped) or a
            factory ``params -> optimizer``. Default: AdamW(lr=3e-4).
        scheduler: ``factory(optimizer) -> LRScheduler`` (or ``factory(optimizer,
            total_steps=N)``); needs ``total_steps``.
        total_steps: the real run's number of optimizer steps.
        grad_accumulation_steps: micro-batches per optimizer step.
        clip_grad_norm: max gradient norm, or None.
        loss_fn / train_step: how a batch becomes a loss (see ``autoprec.batching``).
    """

    optimizer: OptimizerSource = default_optimizer
    scheduler: SchedulerFactory | None = None
    total_steps: int | None = None
    grad_accumulation_steps: int = 1
    clip_grad_norm: float | None = None
    loss_fn: LossFn | None = None
    train_step: TrainStep | None = None
    _cache: dict[tuple[str, int], Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, torch.optim.Optimizer) and not callable(self.optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or a factory params -> optimizer, "
                f"not {type(self.optimizer).__name__}; a Lightning-style dict or list is not "
                "an optimizer: pass the optimizer inside it."
            )
        if self.scheduler is not None and not callable(self.scheduler):
            raise TypeError(
                f"scheduler must be a factory optimizer -> LRScheduler, not "
                f"{type(self.scheduler).__name__}: a scheduler built on your optimizer cannot "
                "drive a trial's copy. Pass e.g. lambda opt: LambdaLR(opt, warmup)."
            )
        if self.total_steps is not None and (
            isinstance(self.total_steps, bool)  # True is an int (found by a hunt)
            or not isinstance(self.total_steps, int)
            or self.total_steps < 1
        ):
            raise ValueError(f"total_steps must be a positive int but got {self.total_steps!r}.")
        if self.scheduler is not None and self.total_steps is None:
            raise ValueError(
                "A scheduler needs total_steps (the real run's optimizer steps): the verdict "
                "must cover every learning rate the schedule reaches."
            )
        # the plan's own check, here before any batch is read (True passed as an int and a
        # number, and failed in the first trial as "autoprec's own code")
        check_step_settings(self.grad_accumulation_steps, self.clip_grad_norm)
        if isinstance(self.optimizer, torch.optim.Optimizer):
            refuse_closure_optimizer(self.optimizer)
        object.__setattr__(self, "grad_accumulation_steps", int(self.grad_accumulation_steps))
        for name, value, form in (
            ("loss_fn", self.loss_fn, "loss_fn(output, target) -> loss"),
            ("train_step", self.train_step, "train_step(plan, batch) -> loss"),
        ):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be a function {form}, not {type(value).__name__}.")
            if isinstance(value, type) and issubclass(value, nn.Module):
                # MSELoss(size_average, reduce) takes two arguments: it passed the arity check
                # and failed at the first step on the data ("Boolean value of Tensor ...")
                raise TypeError(
                    f"{name} is the class {qualified_name(value)}, not a loss: pass an instance, "
                    f"{value.__name__}() (on the command line, a function of yours returning "
                    "the loss, or torch.nn.functional's, e.g. torch.nn.functional:mse_loss)."
                )
            if value is not None:
                refuse_wrong_arity(name, value, form, 2)
        if self.loss_fn is not None and self.train_step is not None:
            raise ValueError("Pass loss_fn or train_step, not both: train_step computes the loss.")

    # -- optimizers ---------------------------------------------------------------------------

    def name_groups_after(self, user_model: nn.Module) -> None:
        """Name the optimizer's groups after ``user_model``'s parameters, once: trials on a copy
        moved to another device (``tune(device=...)``) hold none of the optimizer's own
        parameters, and find theirs by these names (before, every such run failed in its fp32
        reference with "parameters that are not in the model")."""
        if isinstance(self.optimizer, torch.optim.Optimizer):
            self._cache[_PINNED_GROUPS] = named_groups(self.optimizer, user_model)

    def make_optimizer(
        self, user_model: nn.Module, model: nn.Module, *, with_state: bool = False
    ) -> torch.optim.Optimizer:
        """An optimizer over ``model`` (a copy of ``user_model``), never the user's own. With
        ``with_state`` (a trial), a copy of the user's optimizer's state when it has stepped:
        a trial from a late checkpoint then continues the run with its Adam moments, where a
        fresh Adam's first steps are about ``lr`` per weight whatever the gradient's size.
        Without (reading the schedule, the summary), no state is copied."""
        if isinstance(self.optimizer, torch.optim.Optimizer):
            pinned = self._cache.get(_PINNED_GROUPS)
            groups = pinned if pinned is not None else named_groups(self.optimizer, user_model)
            clone = rebuild_optimizer(
                self.optimizer, groups, model, "same", require_fresh=False, share_hooks=False
            )
            if with_state and self.optimizer.state:  # copied: trials never touch the user's
                clone.load_state_dict(copy.deepcopy(self.optimizer.state_dict()))
            return clone
        made = _called(self.optimizer, "optimizer", "(model.parameters())", model.parameters())
        if isinstance(made, dict | list | tuple):
            raise TypeError(
                f"The optimizer factory {qualified_name(self.optimizer)} returned a "
                f"{type(made).__name__} (Lightning's configure_optimizers form), not a "
                "torch.optim.Optimizer. Return the optimizer itself, and pass the lr scheduler "
                "separately (scheduler= / --scheduler, a factory optimizer -> LRScheduler)."
            )
        if not isinstance(made, torch.optim.Optimizer):
            raise TypeError(
                f"The optimizer factory {qualified_name(self.optimizer)} returned "
                f"{type(made).__name__}, not a torch.optim.Optimizer."
            )
        refuse_closure_optimizer(made)
        held = {id(p) for p in model.parameters()}
        if any(id(p) not in held for group in made.param_groups for p in group["params"]):
            # found by a hunt: lambda p: opt (the user's own) was refused as "raised by
            # autoprec's own code: please report it"
            raise ValueError(
                f"The optimizer factory {qualified_name(self.optimizer)} returned an optimizer "
                "over other parameters than the ones it was handed (your own optimizer, or one "
                "built on your model by name): autoprec calls it once per run with that run's "
                "copy's parameters. Build it on its argument, e.g. lambda params: "
                "torch.optim.AdamW(params, lr=...), or pass your optimizer itself."
            )
        return made

    def make_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        """The user's scheduler built on ``optimizer`` (None without one)."""
        if self.scheduler is None:
            return None
        accepts = _total_steps_argument(self.scheduler)
        users = self.optimizer if isinstance(self.optimizer, torch.optim.Optimizer) else None
        kept = _group_values(users) if users is not None and users is not optimizer else None
        if accepts == "keyword":
            form = f"(optimizer, total_steps={self.total_steps})"
            made = _called(
                self.scheduler, "scheduler", form, optimizer, total_steps=self.total_steps
            )
        elif accepts == "positional":
            form = f"(optimizer, {self.total_steps})"
            made = _called(self.scheduler, "scheduler", form, optimizer, self.total_steps)
        else:
            made = _called(self.scheduler, "scheduler", "(optimizer)", optimizer)
        foreign = getattr(made, "optimizer", optimizer)
        if foreign is not optimizer:
            changed = ""
            if users is not None and kept is not None:
                _put_group_values(users, kept)  # what building a scheduler on it changed
            elif (
                isinstance(foreign, torch.optim.Optimizer)
                and getattr(made, "last_epoch", None) == 0
            ):
                # just built (not a scheduler built beforehand and stepped: found by a review)
                # on one autoprec does not hold (optimizer= is a factory): what building it
                # left there is said, as it cannot be put back (found by a hunt)
                lrs = [plain_value(group["lr"]) for group in foreign.param_groups]
                changed = (
                    f" If the factory built it now, that set the optimizer's lrs to the "
                    f"schedule's first ({lrs}, with initial_lr beside them): rebuild it before "
                    "you train with it."
                )
            raise ValueError(
                f"The scheduler factory {qualified_name(self.scheduler)} returned a scheduler "
                "of another optimizer than the one it was handed (a scheduler built "
                "beforehand, or on your own optimizer by name): autoprec calls it once per "
                "run with that run's optimizer, and stepping it would have stepped yours. "
                "Build it on its argument, e.g. lambda optimizer: "
                f"torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=...).{changed}"
            )
        if not callable(getattr(made, "step", None)):
            raise TypeError(
                f"The scheduler factory {qualified_name(self.scheduler)} returned "
                f"{type(made).__name__}, not an lr scheduler (an object with step(), such as "
                "torch.optim.lr_scheduler.LambdaLR(optimizer, ...))."
            )
        return made

    # -- learning rates -----------------------------------------------------------------------

    def schedule(self, model: nn.Module) -> list[tuple[float, ...]]:
        """Each group's lr at every optimizer step of the real run (one entry without a
        scheduler: the optimizer's own lrs). Read from a throwaway optimizer over ``model``, the
        scheduler stepped ``total_steps`` times (about 2 s per 100k steps of a LambdaLR)."""
        return self._read_schedule(model)[0]

    def momentum_schedule(self, model: nn.Module) -> list[tuple[float, ...]] | None:
        """Each group's momentum (β1 or SGD's ``momentum``) at every step, when the scheduler
        sets it to anything but the optimizer's own; else None."""
        return self._read_schedule(model)[1]

    def _read_schedule(
        self, model: nn.Module
    ) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]] | None]:
        key = ("schedule", id(model))
        if key in self._cache:
            return self._cache[key]
        optimizer = self.make_optimizer(model, model)
        if self.scheduler is not None:
            _from_initial_lrs(optimizer)
        own = group_momenta(optimizer)
        with warnings.catch_warnings():  # stepping a scheduler without optimizer.step()
            warnings.simplefilter("ignore")
            scheduler = self.make_scheduler(optimizer)
            _require_readable(scheduler)
        steps = (self.total_steps or 1) if scheduler is not None else 1
        try:
            lrs, momenta = step_schedule(optimizer, scheduler, steps)
        except Exception as error:
            factory = qualified_name(self.scheduler) or "your factory"
            said = (str(error).splitlines() or [""])[0]
            raise ValueError(
                f"Stepping the scheduler from {factory} through the run's total_steps={steps} "
                f"(--total-steps; to read the lrs trials train at) raised "
                f"{type(error).__name__}: {said}. total_steps counts optimizer steps, not "
                "micro-batches: give the length your scheduler was built for, and a scheduler "
                "whose step() takes no argument (as torch's do)."
            ) from error
        scheduled = momenta if own is not None and any(m != own for m in momenta) else None
        self._cache[key] = (lrs, scheduled)
        return lrs, scheduled

    def lr_points(
        self, model: nn.Module, floor_quantile: float = FLOOR_QUANTILE
    ) -> tuple[LrPoint, ...]:
        """The learning rates trials train at: the peak and, under a decaying schedule, the
        floor (``floor_quantile``). Raises when the run never moves (lr 0 everywhere)."""
        if not 0 <= floor_quantile < 1:
            raise ValueError(f"floor_quantile must be in [0, 1) but got {floor_quantile}.")
        lrs = self.schedule(model)
        _refuse_unusable_lrs(lrs)
        if self.scheduler is None:
            _require_moving(lrs[0], self.optimizer)
            return (LrPoint(role="constant", lrs=lrs[0]),)
        return schedule_points(
            lrs, self.momentum_schedule(model), self.total_steps or 1, floor_quantile
        )

    def summary(self, model: nn.Module) -> RecipeSummary:
        """The recipe as data (``model``: the user's, to read the optimizer's groups from)."""
        key = ("summary", id(model))
        if key in self._cache:
            return self._cache[key]
        optimizer = self.make_optimizer(model, model)
        groups = tuple(
            {
                key: plain_value(value)
                for key, value in sorted(group.items())
                if key not in ("params", "initial_lr")
            }
            for group in optimizer.param_groups
        )
        summary = RecipeSummary(
            optimizer=qualified_name(type(optimizer)) or "",
            optimizer_groups=groups,
            scheduler=qualified_name(self.scheduler),
            total_steps=self.total_steps,
            grad_accumulation_steps=self.grad_accumulation_steps,
            clip_grad_norm=self.clip_grad_norm,
            loss_fn=qualified_name(self.loss_fn),
            train_step=qualified_name(self.train_step),
            lr_points=self.lr_points(model),
            optimizer_state_steps=self._state_steps(),
        )
        self._cache[key] = summary
        return summary

    def _state_steps(self) -> int | None:
        """The most steps a parameter of the user's optimizer had taken (None: no state)."""
        if not isinstance(self.optimizer, torch.optim.Optimizer) or not self.optimizer.state:
            return None
        steps = [
            float(state["step"])
            for state in self.optimizer.state.values()
            if isinstance(state.get("step"), torch.Tensor | int | float)
        ]
        return int(max(steps, default=0))


def scheduled_lr_note(recipe: TrainingRecipe) -> str | None:
    """A note when trials train at the lr a scheduler left on the optimizer passed, with no
    scheduler given (its groups carry ``initial_lr`` and another ``lr``): right for a check
    from a run's checkpoint, and a surprise mid-warm-up (trials at 1e-6 of a 1e-3 run)."""
    if recipe.scheduler is not None or not isinstance(recipe.optimizer, torch.optim.Optimizer):
        return None
    moved = [
        (float(group["initial_lr"]), float(group["lr"]))
        for group in recipe.optimizer.param_groups
        if "initial_lr" in group and float(group["lr"]) != float(group["initial_lr"])
    ]
    if not moved:
        return None
    initial, current = moved[0]
    return (
        f"Trials train at the optimizer's current lr {current:g}, which a scheduler moved from "
        f"its initial_lr {initial:g}, and at no other: no scheduler was passed. Right for a "
        "check from your run's checkpoint; to judge every lr your schedule reaches, pass "
        "scheduler=FACTORY and total_steps=N (CLI: --scheduler, --total-steps)."
    )


def _total_steps_argument(factory: SchedulerFactory) -> Literal["keyword", "positional"] | None:
    """How a scheduler factory takes the run's length: as ``total_steps=``, or as a required
    second positional argument of a function (``lambda optimizer, steps: ...``: found by a
    hunt, it was called with the optimizer alone and failed), or not at all. A scheduler class
    passed as the factory is never handed it: ``StepLR``'s second argument is its step size."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(parameter.name == "total_steps" for parameter in parameters):
        return "keyword"
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    second = parameters[1] if len(parameters) > 1 else None
    if (
        not inspect.isclass(factory)
        and second is not None
        and second.kind in positional
        and second.default is inspect.Parameter.empty
    ):
        return "positional"
    return None


def _called(factory: Callable[..., Any], role: str, form: str, *args: Any, **kwargs: Any) -> Any:
    """``factory(*args, **kwargs)``, called as ``form``; what it raises becomes one line naming
    the factory and the call (a RuntimeError in the user's scheduler factory ended the CLI in
    a traceback, a factory taking no arguments in a TypeError that named no flag)."""
    try:
        return factory(*args, **kwargs)
    except Exception as error:
        # a functools.partial has no __name__: its function's (it read "scheduler(optimizer)")
        name = getattr(factory, "__name__", None) or getattr(factory, "func", None)
        name = getattr(name, "__name__", None) or name or role
        hint = ""
        if role == "scheduler" and isinstance(error, TypeError) and "required" in str(error):
            # found by a hunt: partial(get_cosine_schedule_with_warmup, num_warmup_steps=100)
            # left num_training_steps keyword-only, never handed the run's length
            hint = (
                ". autoprec hands the run's length as total_steps= or as a required second "
                "positional argument: e.g. lambda optimizer, steps: "
                "get_cosine_schedule_with_warmup(optimizer, 100, steps)"
            )
        raise ValueError(
            f"The {role} factory {qualified_name(factory)}, called as {name}{form}, raised "
            f"{type(error).__name__}: {error}{hint}"
        ) from error


def _from_initial_lrs(optimizer: torch.optim.Optimizer) -> None:
    """Set each group of a clone of the user's optimizer back to the lr its schedule starts
    from (``initial_lr``, where a scheduler built on it left one), as SequentialLR's
    constructor does: a chainable scheduler (LinearLR, CosineAnnealingLR, StepLR, ...) computes
    from the group's current lr, and one read from a clone of an optimizer a scheduler had
    already moved ran the whole schedule scaled by current/initial (found by a hunt: a LinearLR
    warm-up built before tune() read 1e-5 for a run that peaks at 1e-3)."""
    for group in optimizer.param_groups:
        if "initial_lr" in group:
            initial = group["initial_lr"]
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                lr.fill_(float(initial))  # a tensor lr is updated in place, as schedulers do
            else:
                group["lr"] = initial


def _require_readable(scheduler: Any) -> None:
    """Refuse a schedule whose learning rates depend on the run's own metrics."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return
    lowest = min(scheduler.min_lrs)
    raise ValueError(
        f"ReduceLROnPlateau lowers the learning rate when your validation metric stalls, so "
        f"the lrs your run will reach cannot be read ahead of it (factor {scheduler.factor:g}, "
        f"min_lr {lowest:g}). Pass scheduler=None (tune_module and tune_trainer take it "
        "too) to judge your starting lr, and run again with the optimizer at the lowest lr "
        "you expect it to reach (lr x factor^k): pure bf16 and other rounding losses show at "
        "low lrs."
    )


def _refuse_unusable_lrs(schedule: Sequence[Sequence[float]]) -> None:
    """A group's lr that is negative or not finite, at any step the schedule reaches (found by
    a hunt: one group at -1e-3 leaked pydantic's "1 validation error for LrPoint", and NaN
    in every group was called "lr is 0")."""
    for step, lrs in enumerate(schedule):
        for group, lr in enumerate(lrs):
            if not math.isfinite(lr) or lr < 0:
                at = "" if len(schedule) == 1 else f" at step {step} of the schedule"
                raise ValueError(
                    f"The optimizer's param group {group} has lr {lr!r}{at}: a learning rate "
                    "must be a finite number >= 0 (a negative one steps uphill). Give each "
                    "group the lr the run trains at."
                )


def _require_moving(lrs: Sequence[float], source: OptimizerSource) -> None:
    if any(lr > 0 for lr in lrs):
        return
    initial = []
    if isinstance(source, torch.optim.Optimizer):
        initial = [g.get("initial_lr") for g in source.param_groups if g.get("initial_lr")]
    hint = (
        f" Its param groups carry initial_lr={initial[0]:g}: a scheduler built on it set the lr "
        "to 0 (warm-up). Pass scheduler=FACTORY and total_steps=N (CLI: --scheduler, "
        "--total-steps) so trials follow the schedule."
        if initial
        else " Give the learning rate the run trains at."
    )
    raise ValueError(
        f"The optimizer's learning rate is 0 in every group ({json.dumps(list(lrs))}): the "
        f"fp32 reference would never move, and nothing can be judged against it.{hint}"
    )
