"""Tune and train inside a Hugging Face ``transformers.Trainer``.

    result = tune_trainer(trainer, budget_minutes=30)   # the Trainer's own recipe
    apply_profile(trainer, result.profile)               # any profile, before train()
    trainer.train()

``tune_trainer`` reads from the Trainer everything a trial must reproduce: the model, its train
dataloader (with the collator), the loss (``compute_loss`` when the Trainer overrides it), the
optimizer and LR scheduler the Trainer would create for its ``max_steps``, gradient
accumulation and ``max_grad_norm``. ``apply_profile`` installs the profile's plan through the
Trainer's own extension points: the plan's model, its optimizer (wrapped so that the Trainer's
``optimizer.step()`` runs the plan's unscale / clip / step), the scheduler rebound to it, the
mode's autocast around every forward pass (``compute_loss_context_manager``) and its backward
(loss scaling for fp16). Every mode works this way, FP8 (torchao) and the pure-bf16 variants with
``keep_fp32`` included; ``TrainingArguments(bf16=/fp16=)`` must stay off (the plan replaces them).
"""

from __future__ import annotations

import contextlib
import copy
import math
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from autoprec.plan import PrecisionPlan
from autoprec.profile import Profile, load_profile
from autoprec.tune_result import TuneResult


def _train_loader(trainer: Any) -> Any:
    if getattr(trainer, "train_dataset", None) is None:
        raise ValueError(
            "The Trainer has no train_dataset: autoprec tunes on the batches the Trainer would "
            "train on. Build it with Trainer(..., train_dataset=...)."
        )
    return trainer.get_train_dataloader()


def max_steps(trainer: Any, loader: Any) -> int:
    """Optimizer steps of the Trainer's run, computed as ``Trainer.train()`` computes them."""
    args = trainer.args
    if args.max_steps > 0:
        return int(args.max_steps)
    per_epoch = max(math.ceil(len(loader) / args.gradient_accumulation_steps), 1)
    return math.ceil(args.num_train_epochs * per_epoch)


def scheduler_factory(trainer: Any) -> Callable[..., Any]:
    """``factory(optimizer, total_steps)``: the scheduler ``Trainer.create_scheduler`` builds
    (``lr_scheduler_type``, warm-up, ``lr_scheduler_kwargs``)."""
    args = trainer.args

    def factory(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        from transformers import get_scheduler

        return get_scheduler(
            args.lr_scheduler_type,
            optimizer,
            num_warmup_steps=args.get_warmup_steps(total_steps),
            num_training_steps=total_steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )

    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)  # an enum in 5.x
    factory.__qualname__ = f"transformers.get_scheduler({str(kind)!r})"
    return factory


def _trainer_optimizer(trainer: Any) -> torch.optim.Optimizer:
    """The Trainer's optimizer: the one it was given, or the one it would create (built here
    and not kept: the Trainer still creates its own)."""
    given = trainer.optimizer
    optimizer = trainer.create_optimizer()  # builds one only when none was given
    trainer.optimizer = given
    return optimizer


def _uses_own_loss(trainer: Any) -> bool:
    """The Trainer computes the loss as the model does (no compute_loss override, no
    ``compute_loss_func``, no label smoothing): trials then call the model and compare its
    outputs too."""
    from transformers import Trainer

    return (
        type(trainer).compute_loss is Trainer.compute_loss
        and getattr(trainer, "compute_loss_func", None) is None
        and not trainer.args.label_smoothing_factor
    )


@contextlib.contextmanager
def _as_the_trainer_trains(trainer: Any) -> Iterator[None]:
    """The Trainer's model with what ``Trainer.train()`` switches on before its first step,
    for as long as tune() runs (its copies keep it), then as it was: activation checkpointing
    (it changes speed and memory) and NEFTune's noisy embeddings (they change the numerics)."""
    model, args = trainer.model, trainer.args
    undo: list[Callable[[], None]] = []
    try:
        if _checkpointing(args) and not _checkpointing_on(model):
            undo.append(_checkpointing_off(model))
            _enable_checkpointing(model, args)
        alpha = getattr(trainer, "neftune_noise_alpha", None)
        if alpha is not None:
            from transformers.integrations.neftune import activate_neftune, deactivate_neftune

            handle = activate_neftune(model, alpha)
            undo.append(lambda: deactivate_neftune(model, handle))
        yield
    finally:
        for step in reversed(undo):
            step()


def _checkpointing(args: Any) -> bool:
    """Does the Trainer checkpoint activations (``activation_checkpointing``; before
    transformers 5, ``gradient_checkpointing``)?"""
    return bool(
        getattr(args, "activation_checkpointing", False)
        or getattr(args, "gradient_checkpointing", False)
    )


def _checkpointing_on(model: Any) -> bool:
    if hasattr(type(model), "is_activation_checkpointing"):  # the other name warns in 5.x
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def _enable_checkpointing(model: Any, args: Any) -> None:
    """As ``Trainer.train()`` enables it (its kwargs, ``every_n_layers`` and ``offload``)."""
    options = dict(
        getattr(args, "activation_checkpointing_kwargs", None)
        or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    extras = {key: options.pop(key) for key in ("every_n_layers", "offload") if key in options}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=options or None, **extras
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options or None, **extras)


def _checkpointing_off(model: Any) -> Callable[[], None]:
    """Undo ``_enable_checkpointing`` (call before it): its input-require-grads hook too,
    which transformers' disable leaves on a model that is not a PEFT model."""
    disable = getattr(model, "activation_checkpointing_disable", None) or (
        model.gradient_checkpointing_disable
    )
    had_input_hook = bool(getattr(model, "_require_grads_hooks", None)) or hasattr(
        model, "_require_grads_hook"
    )

    def off() -> None:
        disable()
        if not had_input_hook and hasattr(model, "disable_input_require_grads"):
            model.disable_input_require_grads()

    return off


def trainer_recipe(trainer: Any, loader: Any = None, **options: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`autoprec.tune` that reproduce the Trainer's training:
    optimizer, scheduler, total_steps, accumulation, clipping and (when the Trainer computes
    the loss its own way) ``train_step``. ``loader``: the Trainer's train dataloader, when
    already built. ``options`` override any of them."""
    if trainer.lr_scheduler is not None and "scheduler" not in options:
        raise ValueError(
            "The Trainer was given an LR scheduler object (optimizers=(optimizer, scheduler)): "
            "autoprec cannot rebuild it for each trial. Pass scheduler=factory(optimizer, "
            "total_steps) to tune_trainer, or let the Trainer build it from TrainingArguments "
            "(lr_scheduler_type)."
        )
    args = trainer.args
    loader = loader if loader is not None else _train_loader(trainer)
    recipe: dict[str, Any] = {
        "optimizer": _trainer_optimizer(trainer),
        "scheduler": scheduler_factory(trainer),
        "total_steps": max_steps(trainer, loader),
        "grad_accumulation_steps": args.gradient_accumulation_steps,
        "clip_grad_norm": args.max_grad_norm or None,
    }
    if not _uses_own_loss(trainer):

        def train_step(plan: PrecisionPlan, batch: Any) -> torch.Tensor:
            return trainer.compute_loss(plan.model, batch)

        recipe["train_step"] = train_step
    recipe.update(options)
    return recipe


def tune_trainer(trainer: Any, budget_minutes: float = 30.0, **options: Any) -> TuneResult:
    """:func:`autoprec.tune` on the Trainer's model, batches and recipe (see the module
    docstring); ``options`` are tune()'s (``modes``, ``objective``, ``eval_fn``, ...) and
    override what is read from the Trainer. The Trainer and its model are left unchanged."""
    from autoprec.tuning import tune

    loader = _train_loader(trainer)
    recipe = trainer_recipe(trainer, loader, **options)
    recipe.setdefault("compile", bool(trainer.args.torch_compile))  # trials train as it will
    with _as_the_trainer_trains(trainer):
        return tune(trainer.model, loader, budget_minutes=budget_minutes, **recipe)


PLAN_STATE_KEY = "autoprec_plan"
"""Where a Trainer checkpoint's ``optimizer.pt`` holds the plan's state (``plan.state_dict()``)."""


class PlanOptimizer(torch.optim.Optimizer):
    """The plan's optimizer as the Trainer sees it: ``step()`` runs the plan's end of a step
    (accumulated gradients written back, unscale, clip, the mode's optimizer step with the loss
    scaler's skip and update); groups and state are the plan optimizer's own objects."""

    def __init__(self, plan: PrecisionPlan, accelerator: Any = None) -> None:
        inner = plan.optimizer
        super().__init__(inner.param_groups, inner.defaults)
        self.plan = plan
        self.param_groups = inner.param_groups  # the same dicts: the scheduler sets their lr
        self.state = inner.state
        self.accelerator = accelerator
        self._reported_norm: torch.Tensor | None = None
        for name in ("train", "eval"):
            # schedule-free optimizers: the Trainer calls optimizer.train()/.eval() when they
            # exist; hidden here, one never entered train mode and its step failed (found by
            # a hunt). Only an optimizer that has them shows them.
            method = getattr(inner, name, None)
            if callable(method):
                setattr(self, name, method)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Into the plan's optimizer, which translates and refuses a group as it did the rest
        (a callback unfreezing a head through ``trainer.optimizer`` skipped that: Adam's L2
        decay went into bitsandbytes' Adam8bit as decoupled decay; found by a hunt)."""
        if not hasattr(self, "plan"):  # torch's constructor adds the first groups
            super().add_param_group(param_group)
            return
        self.plan.optimizer.add_param_group(param_group)

    def grad_norm_to_report(self, _model: Any = None, grad_norm: Any = None) -> torch.Tensor:
        """The Trainer's ``_get_grad_norm``: it reads ``.grad`` before ``step()``, where the
        gradients are still loss-scaled (fp16) or not yet written back (pure bf16 with
        accumulation), and logged nan, inf or 0. This returns a 0-d tensor that ``step()``
        fills with the norm the plan measures after unscaling; the Trainer reads it when it
        logs, after the step (no host sync here)."""
        device = next(iter(self.plan.model.parameters()), torch.empty(0)).device
        self._reported_norm = torch.full((), math.nan, device=device)
        return self._reported_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan, mode = self.plan, self.plan.mode
        mode.gradients_ready()
        clip = plan.clip_grad_norm if plan.clip_grad_norm is not None else math.inf
        norm = plan.clip_step_gradients(clip)  # inf: measured for the Trainer's log only
        if self._reported_norm is not None:
            self._reported_norm.copy_(norm)
            self._reported_norm = None
        self._report_skipped(not mode.optimizer_step(plan.optimizer))
        return loss

    def _report_skipped(self, skipped: bool) -> None:
        """The Trainer steps its lr scheduler only when ``accelerator.optimizer_step_was_skipped``
        is False, which Accelerate reads from its own GradScaler: the plan's replaces it, so
        the plan's skip is told to Accelerate's wrapper of this optimizer (its ``_is_overflow``,
        accelerate 1.x) and a step the loss scaler skipped holds the schedule, as in a plain
        fp16 Trainer."""
        for wrapper in getattr(self.accelerator, "_optimizers", ()):
            if getattr(wrapper, "optimizer", None) is self and hasattr(wrapper, "_is_overflow"):
                wrapper._is_overflow = skipped

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.plan.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The plan optimizer's state, with the plan's own (the fp16 loss scale, step counters)
        under ``PLAN_STATE_KEY``: the Trainer saves this one dict as ``optimizer.pt``. A plain
        torch optimizer's load ignores the extra key."""
        return {**self.plan.optimizer.state_dict(), PLAN_STATE_KEY: self.plan.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint's ``optimizer.pt``: the optimizer's state into the plan's
        optimizer (any mode's, translated), and the plan's own when it was saved (a checkpoint
        of a plain Trainer has none: the plan's state stays fresh)."""
        state_dict = dict(state_dict)
        plan_state = state_dict.pop(PLAN_STATE_KEY, None)
        if plan_state is not None:
            self.plan.checked_state(plan_state)  # a refused plan state loads nothing at all
        self.plan.optimizer.load_state_dict(state_dict)
        if plan_state is not None:
            self.plan.load_state_dict(plan_state)


def _with_autocast(trainer: Any, plan: PrecisionPlan) -> None:
    own = trainer.compute_loss_context_manager

    def compute_loss_context_manager(self: Any) -> contextlib.ExitStack:
        stack = own()
        stack.enter_context(plan.autocast())
        return stack

    trainer.compute_loss_context_manager = types.MethodType(compute_loss_context_manager, trainer)


def apply_profile(trainer: Any, profile: Profile | str | Path) -> PrecisionPlan:
    """Set the Trainer up to train in ``profile`` (a Profile or its path); call once, before
    ``trainer.train()``. The Trainer's optimizer and scheduler (the ones it was given or would
    create) go through ``profile.apply``; the plan then does the clipping (after unscaling),
    so ``trainer.args`` becomes a copy with ``max_grad_norm`` 0 (the caller's object is left
    as it was). Returns the plan."""
    profile = profile if isinstance(profile, Profile) else load_profile(profile)
    # after train(), Accelerate wraps the plan's optimizer (AcceleratedOptimizer.optimizer):
    # the second call was refused for a scheduler instead (found by a hunt)
    installed = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if isinstance(installed, PlanOptimizer):
        raise ValueError(
            "apply_profile() was already called on this Trainer (its model is converted for "
            f"{installed.plan.spec.label}); a second profile would convert it again "
            "and rebind a scheduler the first call built. Build a new Trainer over a fresh "
            "model, or resume its checkpoint under the new profile (resume_from_checkpoint)."
        )
    if getattr(trainer, "model_init", None) is not None:
        raise ValueError(
            "The Trainer was built with model_init: train() builds a fresh model and optimizer "
            "from it, which would throw away the profile's converted model and optimizer (and "
            "train fp32, unclipped: the plan took over clipping). Build the Trainer with "
            "model=model_init() instead, then call apply_profile()."
        )
    args = trainer.args
    if args.bf16 or args.fp16:
        raise ValueError(
            "TrainingArguments has bf16/fp16 on: the Trainer's own mixed precision would run "
            f"on top of the profile's ({profile.spec.label}). Build TrainingArguments without "
            "bf16/fp16 and let apply_profile() install the profile."
        )
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(
        trainer, "is_fsdp_enabled", False
    ):
        raise ValueError(
            "apply_profile() installs the plan in the Trainer's own backward and optimizer step; "
            "DeepSpeed and FSDP replace both. Use profile.to_accelerate() / to_fsdp2() there."
        )
    if trainer.lr_scheduler is not None and trainer.optimizer is None:
        raise ValueError("The Trainer has an LR scheduler but no optimizer to rebind it from.")
    optimizer = trainer.create_optimizer()  # the one it was given, or the one it would build
    scheduler = trainer.lr_scheduler
    run_steps = max_steps(trainer, _train_loader(trainer))
    if scheduler is None:
        scheduler = scheduler_factory(trainer)(optimizer, run_steps)
    if profile.spec.compile and args.torch_compile:  # the Trainer compiles the model itself
        spec = profile.spec.model_copy(update={"compile": False})
        profile = profile.model_copy(update={"spec": spec})
    plan = profile.apply(
        trainer.model,
        optimizer,
        scheduler,
        grad_accumulation_steps=args.gradient_accumulation_steps,
        clip_grad_norm=args.max_grad_norm or None,
        total_steps=run_steps,  # the schedule compared over this run, not the proven one's
    )
    if getattr(plan.mode, "fp32_accumulation", False):
        # pure bf16 sums micro-batches in fp32 outside .grad, which DDP cannot see: the
        # Trainer's own no_sync() on all but the last reduced that one alone, and replicas
        # drifted apart (found by a review); every micro-batch synchronises instead (this
        # Trainer's accelerator only: Accelerate's sync_each_batch is process-wide state)
        trainer.accelerator.no_sync = _synchronising
        plan.mode.micro_batches_synced = True  # type: ignore[attr-defined]
    trainer.model = trainer.model_wrapped = plan.model
    trainer.optimizer = PlanOptimizer(plan, trainer.accelerator)
    trainer.lr_scheduler = plan.scheduler
    # the plan clips, after unscaling; a copy, so the caller's TrainingArguments keep their
    # max_grad_norm (another Trainer built on them still clips)
    trainer.args = copy.copy(args)
    trainer.args.max_grad_norm = 0.0
    trainer._get_grad_norm = trainer.optimizer.grad_norm_to_report  # the plan's, after the step
    _with_autocast(trainer, plan)
    trainer.accelerator.backward = _plan_backward(plan)
    return plan


def _synchronising(model: Any = None) -> contextlib.AbstractContextManager[None]:
    """Accelerate's ``no_sync(model)``, synchronising: every backward all-reduces."""
    return contextlib.nullcontext()


def _plan_backward(plan: PrecisionPlan) -> Callable[..., None]:
    """Accelerate's ``backward(loss, **kwargs)`` as the plan takes it: its keyword arguments
    (``retain_graph``, a Trainer subclass's) reach the backward pass (they were dropped)."""

    def backward(loss: torch.Tensor, **kwargs: Any) -> None:
        plan.mode.backward(loss, lambda scaled: scaled.backward(**kwargs))

    return backward
