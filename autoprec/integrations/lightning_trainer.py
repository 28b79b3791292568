"""Tune and train inside a Lightning ``Trainer``: :func:`tune_module` and the
:class:`AutoprecPrecision` plugin (imported through ``autoprec.integrations.lightning``).

    result = tune_module(module, train_loader, budget_minutes=30, trainer=trainer)
    trainer = Trainer(..., plugins=[AutoprecPrecision(result.profile)])
    trainer.fit(module, train_loader)

Trials run the module's own ``training_step`` (``self.log`` is quietly ignored there: no Trainer
is attached; ``batch_idx`` passed only when it takes one), ``configure_optimizers`` seeing the
Trainer given as ``self.trainer`` (its ``estimated_stepping_batches`` read from its settings), the
optimizer and LR scheduler of ``configure_optimizers`` in any form Lightning
accepts, and the Trainer's ``accumulate_grad_batches`` / ``gradient_clip_val``. The plugin runs
any profile under automatic optimization, so ``global_step``, checkpoints, schedulers and
gradient clipping behave as with Lightning's own precision plugins.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.plugins.precision import Precision

from autoprec._warnings import warn_caller
from autoprec.errors import RecipeMismatchWarning
from autoprec.plan import PrecisionPlan, _rebind_scheduler
from autoprec.profile import Profile, load_profile
from autoprec.tune_result import TuneResult


class _TrainerView:
    """``self.trainer`` inside ``configure_optimizers`` while tuning: the Trainer given to
    ``tune_module`` (no fit attached it), with ``estimated_stepping_batches`` read from its
    settings and the loader. Sizing the schedule from it is a common Lightning idiom, and it
    failed with "not attached to a Trainer" (found by a hunt)."""

    def __init__(self, trainer: Any, stepping_batches: int | None) -> None:
        self._trainer = trainer
        self._stepping_batches = stepping_batches

    @property
    def estimated_stepping_batches(self) -> int:
        if self._stepping_batches is None:
            raise ValueError(
                "configure_optimizers() reads self.trainer.estimated_stepping_batches, and the "
                "run's length cannot be read: give the Trainer max_steps, or max_epochs with a "
                "loader that has a length."
            )
        return self._stepping_batches

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


@contextlib.contextmanager
def _attached(module: Any, view: _TrainerView | None) -> Any:
    """``view`` as ``module.trainer`` while the block runs, when no Trainer is attached."""
    if view is None or getattr(module, "_trainer", None) is not None:
        yield
        return
    module._trainer = view
    try:
        yield
    finally:
        module._trainer = None


def _single_optimizer(
    module: Any, view: _TrainerView | None = None
) -> tuple[torch.optim.Optimizer, dict[str, Any] | None]:
    """(the optimizer, its scheduler config or None) from ``configure_optimizers()``."""
    try:
        with _attached(module, view):
            configured = module.configure_optimizers()
    except RuntimeError as error:
        if "not attached to a `Trainer`" not in str(error):
            raise
        raise ValueError(
            f"configure_optimizers() reads self.trainer ({error}): pass trainer= to "
            "tune_module, the Trainer you will fit with, and its settings size the schedule "
            "(estimated_stepping_batches)."
        ) from error
    optimizers, schedulers, _ = _configure_optimizers(configured)
    if len(optimizers) != 1:
        raise ValueError(
            f"configure_optimizers() returned {len(optimizers)} optimizers; autoprec tunes a "
            "module trained with exactly one."
        )
    if len(schedulers) > 1:
        raise ValueError(
            f"configure_optimizers() returned {len(schedulers)} LR schedulers; autoprec "
            "reproduces at most one (chain them with SequentialLR)."
        )
    if not schedulers:
        return optimizers[0], None
    config = schedulers[0]
    return optimizers[0], dict(config) if isinstance(config, Mapping) else {"scheduler": config}


def _scheduler_factory(module: Any, view: _TrainerView | None) -> Any:
    """``factory(optimizer)``: the module's scheduler, built by a fresh
    ``configure_optimizers()`` call and rebound to ``optimizer`` (a trial's)."""

    def factory(optimizer: torch.optim.Optimizer) -> Any:
        built, config = _single_optimizer(module, view)
        assert config is not None
        scheduler = config["scheduler"]
        _rebind_scheduler(scheduler, built, optimizer)
        return scheduler

    factory.__qualname__ = f"{type(module).__name__}.configure_optimizers"
    return factory


def _total_steps(trainer: Any, loader: Any, interval: str) -> int | None:
    """Scheduler steps of the Trainer's run: its max_steps or epochs x optimizer steps per
    epoch, whichever ends it first; for an ``interval="epoch"`` scheduler the epochs it
    completes (Lightning steps it only after a whole epoch: a last epoch max_steps cuts short
    is not counted). max_epochs beside max_steps was ignored, and a cut epoch counted (found
    by a hunt)."""
    if trainer is None:
        return None
    steps, epochs = trainer.max_steps, trainer.max_epochs
    per_epoch = None
    if hasattr(loader, "__len__"):
        batches = _batches_per_epoch(len(loader), trainer.limit_train_batches)
        per_epoch = max(-(-batches // trainer.accumulate_grad_batches), 1)
    if interval == "epoch":
        if steps and steps > 0 and per_epoch is not None:
            completed = int(steps) // per_epoch
            return min(completed, int(epochs)) if epochs and epochs > 0 else completed
        return int(epochs) if epochs and epochs > 0 else None
    if steps and steps > 0:
        if epochs and epochs > 0 and per_epoch is not None:
            return min(int(steps), int(epochs) * per_epoch)
        return int(steps)
    if epochs and epochs > 0 and per_epoch is not None:
        return int(epochs) * per_epoch
    return None


def _batches_per_epoch(length: int, limit: int | float | None) -> int:
    """The batches of an epoch Lightning runs under ``limit_train_batches`` (an int: at most
    that many; a float: that share of the loader, as Lightning rounds it)."""
    if limit is None:
        return length
    if isinstance(limit, int) and not isinstance(limit, bool):
        return min(length, limit)
    return length if float(limit) == 1.0 else int(length * float(limit))


def _scheduler_steps(trainer: Any, loader: Any, config: Mapping[str, Any]) -> int | None:
    """Scheduler steps over the Trainer's run, as Lightning takes them: an ``interval="epoch"``
    scheduler every ``frequency`` epochs; an ``interval="step"`` one after each optimizer step
    whose micro-batch index in the epoch (1-based) ``frequency`` divides. The index counts
    micro-batches under accumulation and restarts every epoch, so ``frequency=10`` over 16
    batches an epoch steps once an epoch, not every 10 steps (62 scheduler steps in 1000, read
    as 100 before; found by a hunt). None when the run's length cannot be read."""
    interval = config.get("interval", "epoch")
    frequency = int(config.get("frequency", 1) or 1)
    if interval == "epoch":
        epochs = _total_steps(trainer, loader, "epoch")
        return None if epochs is None else max(epochs // frequency, 1)
    if frequency == 1:
        return _total_steps(trainer, loader, "step")
    if trainer is None:
        return None
    accumulation = int(trainer.accumulate_grad_batches)
    every = math.lcm(accumulation, frequency) // accumulation  # optimizer steps a scheduler step
    steps, epochs = trainer.max_steps, trainer.max_epochs
    if not hasattr(loader, "__len__"):  # one endless epoch: the index never restarts
        return max(int(steps) // every, 1) if steps and steps > 0 else None
    batches = _batches_per_epoch(len(loader), trainer.limit_train_batches)
    per_epoch_steps = max(-(-batches // accumulation), 1)
    stepped = batches // (every * accumulation)  # the optimizer steps whose index it divides
    if batches % accumulation and batches % frequency == 0:
        stepped += 1  # the epoch's last, partial accumulation steps the optimizer at ``batches``
    if steps and steps > 0:
        full, rest = divmod(int(steps), per_epoch_steps)
        if epochs and epochs > 0 and full >= epochs:
            full, rest = int(epochs), 0
        return max(full * stepped + rest // every, 1)
    return max(int(epochs) * stepped, 1) if epochs and epochs > 0 else None


def _ignore(*_args: Any, **_kwargs: Any) -> None:
    return None


def _training_step(plan: PrecisionPlan, batch: Any) -> torch.Tensor:
    """The module's own ``training_step``, ``self.log`` / ``self.log_dict`` ignored."""
    module = plan.model
    module.log = module.log_dict = _ignore  # instance attributes on the trial's copy
    # Lightning passes batch_idx only to a training_step that takes it; `(self, batch)` failed
    # here with a TypeError blamed on the batches (found by a hunt)
    output = (
        module.training_step(batch, 0) if _takes_batch_idx(module) else module.training_step(batch)
    )
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"training_step returned {type(output).__name__}; autoprec needs the loss "
            '(a tensor, or a dict with "loss"), as automatic optimization does.'
        )
    return loss


def _takes_batch_idx(module: Any) -> bool:
    """Does ``module.training_step`` take a second positional argument, as Lightning decides
    whether to pass ``batch_idx``?"""
    try:
        parameters = inspect.signature(module.training_step).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def module_recipe(module: Any, loader: Any, trainer: Any = None, **options: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`autoprec.tune` that reproduce the module's training
    (optimizer, scheduler, total steps, accumulation, clipping, ``train_step``); ``options``
    override any of them."""
    if not getattr(module, "automatic_optimization", True):
        # its training_step steps optimizers itself (manual_backward, opt.step()): a trial
        # failed at its first step with "Manual is not attached to a Trainer", blamed on the
        # batches (found by a hunt)
        raise ValueError(
            f"{type(module).__name__} uses manual optimization (automatic_optimization=False): "
            "its training_step runs backward and steps optimizers itself, which autoprec's "
            "trials cannot reproduce. Tune with autoprec.tune(module, loader, train_step=...) "
            "and a train_step that returns the loss, as your training_step computes it."
        )
    view = None if trainer is None else _TrainerView(trainer, _total_steps(trainer, loader, "step"))
    optimizer, config = _single_optimizer(module, view)
    recipe: dict[str, Any] = {"optimizer": optimizer, "train_step": _training_step}
    if config is not None:
        interval = config.get("interval", "epoch")
        recipe["scheduler"] = _scheduler_factory(module, view)
        recipe["total_steps"] = _scheduler_steps(trainer, loader, config)
        if recipe["total_steps"] is None and "total_steps" not in options:
            raise ValueError(
                f"configure_optimizers() returns an LR scheduler (interval={interval!r}): pass "
                "trainer= (with max_steps or max_epochs) or total_steps= (the scheduler's "
                "steps over the whole run) so every lr it reaches is judged."
            )
    if trainer is not None:
        if _clips_by_value(trainer):
            raise ValueError(
                f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}: autoprec's "
                "trials clip by norm only; tune without clipping by value or clip by norm."
            )
        _refuse_accumulation_schedule(trainer)
        recipe["grad_accumulation_steps"] = trainer.accumulate_grad_batches
        recipe["clip_grad_norm"] = trainer.gradient_clip_val or None
    recipe.update(options)
    return recipe


def tune_module(
    module: Any,
    train_dataloaders: Iterable[Any],
    budget_minutes: float = 30.0,
    trainer: Any = None,
    **options: Any,
) -> TuneResult:
    """:func:`autoprec.tune` on a LightningModule: its ``training_step``, its
    ``configure_optimizers`` and (from ``trainer``, when given) ``max_steps`` / ``max_epochs``,
    ``accumulate_grad_batches`` and ``gradient_clip_val``. ``options`` are tune()'s and
    override what is read. The module is left unchanged."""
    from autoprec.tuning import tune

    recipe = module_recipe(module, train_dataloaders, trainer, **options)
    return tune(module, train_dataloaders, budget_minutes=budget_minutes, **recipe)


def _clips_by_value(trainer: Any) -> bool:
    """Does the Trainer clip gradients by value (``gradient_clip_algorithm="value"``)?"""
    return trainer is not None and trainer.gradient_clip_algorithm not in (None, "norm")


def _trainer_clip_norm(trainer: Any) -> float | None:
    """The norm the Trainer clips gradients to (``gradient_clip_val``); None when it does not
    clip by norm (clipping by value is no norm the recipe could have been tuned with)."""
    if trainer is None or _clips_by_value(trainer):
        return None
    return trainer.gradient_clip_val or None


def _warn_of_value_clipping(trainer: Any) -> None:
    """A Trainer that clips gradients by value trains otherwise than any profile's trials
    (they clip by norm only, and tune_module refuses value clipping): named, not silent."""
    if not _clips_by_value(trainer) or not trainer.gradient_clip_val:
        return
    warn_caller(
        RecipeMismatchWarning(
            f"the Trainer clips gradients by value (gradient_clip_val="
            f"{trainer.gradient_clip_val}, gradient_clip_algorithm="
            f"{trainer.gradient_clip_algorithm!r}); the profile was proven without it (autoprec's "
            "trials clip by norm only), so its verdict does not cover this run: clip by norm "
            "(gradient_clip_algorithm='norm') and tune with that clipping"
        ),
    )


def _refuse_accumulation_schedule(trainer: Any) -> None:
    """A ``GradientAccumulationScheduler`` sets ``accumulate_grad_batches`` at each epoch start,
    after the plan is built for one value: under pure bf16 the later micro-batches were summed
    in bf16 ``.grad``, what the plan's fp32 sums exist to avoid (found by a hunt)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    for callback in getattr(trainer, "callbacks", None) or ():
        if isinstance(callback, GradientAccumulationScheduler):
            factors = set(callback.scheduling.values())
            if factors != {trainer.accumulate_grad_batches}:
                raise ValueError(
                    f"autoprec tunes and trains with one gradient accumulation, and a "
                    f"GradientAccumulationScheduler changes it by epoch ({callback.scheduling}). "
                    "Train with a constant Trainer(accumulate_grad_batches=N) instead of the "
                    "callback, and tune with that N."
                )


def _run_scheduler_steps(trainer: Any, lr_schedulers: list[Any]) -> int | None:
    """The scheduler's steps over the Trainer's run, as ``module_recipe`` reads them (interval
    and frequency; the batches of an epoch from its train dataloader), for ``apply()`` to
    compare the schedule over: a run 10x the proven one ended at lr 9e-16 against a proven
    floor of 1.25e-4, unnamed (found by a hunt). None when it cannot be read."""
    if trainer is None or not lr_schedulers:
        return None
    config = lr_schedulers[0]
    try:
        loader = getattr(trainer, "train_dataloader", None)
        if loader is None:
            # at connect the loader is not loaded yet: a run given by max_epochs had no length
            # (10x the proven one went unwarned) and an epoch-interval one read max_epochs
            # alone (the proven run itself was warned; found by a hunt). Lightning loads it
            # for this property, as it does for a configure_optimizers that reads it.
            trainer.estimated_stepping_batches  # noqa: B018
            loader = getattr(trainer, "train_dataloader", None)
        settings = {
            "interval": getattr(config, "interval", "epoch"),
            "frequency": getattr(config, "frequency", 1),
        }
        return _scheduler_steps(trainer, loader, settings)
    except Exception:  # noqa: BLE001 - compared over the proven run's length, as before
        return None


_WEIGHT_CONVERTING_MODES = (
    "bf16_pure",
    "bf16_sr",
    "bf16_kahan",
    "bf16_sr_kahan",
    "fp8_torchao",
    "fp8_te",
)
"""Modes whose conversion casts the model's weights or swaps its modules."""


class AutoprecPrecision(Precision):
    """``Trainer(plugins=[AutoprecPrecision(profile)])``: train in a profile's mode (a Profile
    or its path) under automatic optimization. The plan is built when the Trainer connects the
    module and its optimizer (``configure_optimizers``; the scheduler is rebound when the mode
    rebuilds the optimizer); the mode's autocast wraps every step, its backward scales the loss
    for fp16, and ``optimizer_step`` writes accumulated gradients back, unscales, lets
    Lightning clip, then steps with the loss scaler's skip and update."""

    def __init__(self, profile: Profile | str | Path) -> None:
        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        self.plan: PrecisionPlan | None = None
        self._pending_state: dict[str, Any] | None = None

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> Any:
        if self.plan is not None and list(optimizers) == [self.plan.optimizer]:
            # validate / test / predict after fit on this Trainer: connected with the
            # optimizers fit kept (applying again was refused: "already converted")
            return model, optimizers, lr_schedulers
        if not optimizers:  # validate / test / predict without fit: nothing to convert
            if self.plan is None:
                warn_caller(
                    f"AutoprecPrecision has no plan on this Trainer (validate, test or predict "
                    f"before any fit): the module runs as it is, not under "
                    f"{self.profile.spec.label}'s autocast. Evaluate with the Trainer that fit "
                    "it, or apply the profile to the module first.",
                    UserWarning,
                )
            return model, optimizers, lr_schedulers
        if len(optimizers) != 1 or len(lr_schedulers) > 1:
            raise ValueError(
                f"AutoprecPrecision trains with one optimizer and at most one LR scheduler; "
                f"configure_optimizers() gave {len(optimizers)} and {len(lr_schedulers)}."
            )
        # under DDP: the LightningModule inside; a LightningModule's own child named
        # ``module`` is not a wrapper's (it was converted in place of the whole model)
        module = model if isinstance(model, LightningModule) else getattr(model, "module", model)
        if module is not model:
            self._refuse_converting_inside(model)
        trainer = getattr(module, "_trainer", None)
        _refuse_accumulation_schedule(trainer)
        accumulation = trainer.accumulate_grad_batches if trainer is not None else 1
        scheduler = lr_schedulers[0].scheduler if lr_schedulers else None
        _warn_of_value_clipping(trainer)
        self.plan = self.profile.apply(
            module,
            optimizer=optimizers[0],
            scheduler=scheduler,
            grad_accumulation_steps=accumulation,
            clip_grad_norm=_trainer_clip_norm(trainer),
            total_steps=_run_scheduler_steps(trainer, lr_schedulers),
        )  # compared with the recipe; Lightning clips (after our unscale), never plan.step()
        if self._pending_state is not None:
            self.plan.load_state_dict(self._pending_state)
            self._pending_state = None
        return model, [self.plan.optimizer], lr_schedulers

    def _refuse_converting_inside(self, wrapper: Any) -> None:
        """Lightning connects the precision plugin after the strategy wrapped the module (DDP),
        so the plan converts the module inside the wrapper. Modes that cast the weights or
        swap modules cannot be converted there: DDP's gradient buckets are built for the fp32
        weights (with keep_fp32 the fit failed in DDP's reducer, "parameters that were not used
        in producing the loss"), and pure bf16's input cast on the module then caught
        ``training_step``'s batch, rounding its targets to bf16 (found by a hunt). Autocast
        modes leave the weights as DDP saw them."""
        spec = self.profile.spec
        if spec.mode not in _WEIGHT_CONVERTING_MODES:
            return
        raise ValueError(
            f"AutoprecPrecision cannot run {spec.label} under {type(wrapper).__name__}: Lightning "
            "hands the plugin the module after the strategy wrapped it, and this mode casts "
            "the weights or swaps modules, which the wrapper was built before (its gradient "
            "buckets hold the fp32 weights). Fit it on one device (strategy='auto', devices=1), "
            "or apply the profile in your own loop and wrap plan.model in DDP afterwards; "
            "autocast modes (amp_bf16, amp_fp16, tf32) run under DDP with the plugin."
        )

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return self.plan.autocast() if self.plan is not None else contextlib.nullcontext()

    def backward(
        self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        if self.plan is None:
            super().backward(tensor, model, optimizer, *args, **kwargs)
            return
        # through the module's own backward hook, with manual_backward's arguments (both were
        # skipped: an overridden LightningModule.backward never ran, retain_graph was dropped)
        self.plan.mode.backward(tensor, lambda scaled: model.backward(scaled, *args, **kwargs))

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        if self.plan is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()  # training_step and backward
        mode = self.plan.mode
        mode.gradients_ready()
        if closure_result is None and getattr(model, "automatic_optimization", True):
            # training_step returned None: Lightning skips the step. Not unscaled: an unscale
            # with no step after it would leave the fp16 scaler unscaled for the next step
            self._after_closure(model, optimizer)
            return None
        mode.unscale_gradients(self.plan.optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, clipping
        mode.optimizer_step(self.plan.optimizer)
        return closure_result

    def state_dict(self) -> dict[str, Any]:
        return self.plan.state_dict() if self.plan is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.plan is None:
            self._pending_state = state_dict  # restored before connect: applied there
        else:
            self.plan.load_state_dict(state_dict)
