"""PrecisionPlan: what training code touches. ``prepare(spec, model, optimizer)`` builds one.

plan = autoprec.load_profile("profiles/example-cpu-amp_bf16.json").apply(model, optimizer)
for batch in loader:
    with plan.autocast():
        loss = loss_fn(plan.model(batch))
    plan.step(loss)   # backward, unscale, clip, optimizer step, scaler update, zero_grad
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import types
import weakref
from typing import Any

import torch
from torch import nn

from autoprec._warnings import warn_caller
from autoprec._wording import first_names
from autoprec.eligibility import Situation, situations_for_model
from autoprec.errors import (
    OptimizerRebuiltWarning,
    OutsideOptimizerWarning,
    PrecisionSwitchWarning,
    RecipeMismatchWarning,
    UnsupportedModeError,
)
from autoprec.layer_keep import loaded_in_low_precision
from autoprec.layer_kinds import refuse_torchscript, uncalled_kept_module, unknown_name_refusal
from autoprec.model_copies import (
    CompiledForward,
    inside_compile_wrapper,
    refuse_parallel_wrapper,
)
from autoprec.modes import PrecisionMode, mode_for
from autoprec.optim import named_groups
from autoprec.specs import ModeSpec
from autoprec.weight_dtypes import fp32_fix, non_fp32_weights, stored_values

PLAN_STATE_KEYS = frozenset({"spec", "mode", "micro_step"})
"""What :meth:`PrecisionPlan.state_dict` holds."""


CONVERTED_MARK = "_autoprec_converted_for"
"""The attribute naming the mode a model was converted for (a second conversion is refused
with that name, not with advice to cast it back to fp32)."""


def _changes_the_model(mode: PrecisionMode, spec: ModeSpec, compiled_by_user: bool) -> bool:
    """Does building the plan leave anything on the model (casts, swaps, hooks, a compiled
    forward)? fp32 and tf32 uncompiled leave nothing: those may be prepared again."""
    converts = type(mode).convert_module is not PrecisionMode.convert_module
    return converts or (spec.compile and not compiled_by_user)


def _converted_for(model: Any) -> str | None:
    """The mode a conversion left on ``model`` or on any module in it ("for amp_bf16 (on its
    module 'body')"), None when none did. Every module of a converted model carries the mark:
    a wrapper around it, a parent of a converted module or a module of a converted model was
    converted again, and a second fp32 island left autocast off for the layers after it
    (found by a hunt)."""
    if not isinstance(model, nn.Module):
        return None
    inner = inside_compile_wrapper(model)  # explicit: an empty nn.Sequential is falsy
    root = model if inner is None else inner
    for name, module in root.named_modules(remove_duplicate=False):
        label = vars(module).get(CONVERTED_MARK)
        if label is not None:
            return label if not name else f"{label} (on its module {name!r})"
    return None


def check_step_settings(grad_accumulation_steps: Any, clip_grad_norm: Any) -> None:
    """Refuse step settings that would silently change training (a clip of 0 freezes the
    model, a negative one steps uphill; 2.5 accumulation steps stepped every 5 micro-batches
    with each loss divided by 2.5)."""
    if isinstance(grad_accumulation_steps, bool) or not isinstance(
        grad_accumulation_steps, numbers.Integral
    ):
        raise TypeError(
            "grad_accumulation_steps must be a whole number of micro-batches per optimizer "
            f"step but got {grad_accumulation_steps!r}."
        )
    if grad_accumulation_steps < 1:
        raise ValueError(f"grad_accumulation_steps must be >= 1 but got {grad_accumulation_steps}.")
    if clip_grad_norm is None:
        return
    if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, numbers.Real):
        raise TypeError(
            f"clip_grad_norm must be a number, None for no clipping (or, in apply(), "
            f'"recipe" for the tuned recipe\'s) but got {clip_grad_norm!r}.'
        )
    if not 0 < clip_grad_norm <= math.inf:  # NaN: every weight NaN
        raise ValueError(
            f"clip_grad_norm must be positive but got {clip_grad_norm}; for no clipping pass "
            "None to prepare()/apply(), or math.inf to plan.step() (where None means the "
            "plan's own clip)."
        )


def check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    """Refuse anything but a module and a torch optimizer, before anything is converted."""
    if not isinstance(model, nn.Module):
        swapped = (
            " (the arguments are swapped?)" if isinstance(model, torch.optim.Optimizer) else ""
        )
        raise TypeError(f"model must be a torch.nn.Module but got {type(model).__name__}{swapped}.")
    refuse_parallel_wrapper(model)
    refuse_torchscript(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer but got {type(optimizer).__name__}."
        )
    refuse_closure_optimizer(optimizer)


def refuse_closure_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer whose ``step`` needs a closure (LBFGS re-evaluates the loss within a step):
    it passed ``apply()``, then ``plan.step`` raised torch's "missing ... 'closure'", and
    ``check()`` blamed the batches."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"{type(optimizer).__name__}.step needs a closure (it evaluates the loss itself, "
            "several times a step): autoprec's plans and trials step once per backward pass. "
            "Use an optimizer whose step takes no closure (AdamW, SGD, ...)."
        )


def _zero_grad_tells_mode(optimizer: torch.optim.Optimizer, mode: Any) -> None:
    """``optimizer.zero_grad()`` also drops what the mode keeps about the gradients: the sums
    beside ``.grad`` (pure bf16 sums micro-batches in fp32, ``.grad`` empty between them: a
    ``zero_grad`` within a step's micro-batches discarded nothing, and the sums came back at
    the step), amp_fp16's record that they were unscaled."""
    zero_grad = type(optimizer).zero_grad

    def discarding(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("param") is None:  # torch-optimi's gradient release zeroes one param
            mode.discard_accumulated()
        zero_grad(self, *args, **kwargs)  # (a fixed signature broke its zero_grad(param=))

    optimizer.zero_grad = types.MethodType(discarding, optimizer)  # type: ignore[method-assign]


def _resumed_micro_step(state: dict[str, Any], accumulation: int) -> int:
    """The micro-batch count to resume at. Under another ``grad_accumulation_steps`` than the
    checkpoint's, the count is taken in whole optimizer steps, so the next step accumulates
    ``accumulation`` new micro-batches (the raw count made it a partial one: 4 saved under 4,
    resumed under 3, stepped after 2). A checkpoint saved within a step's micro-batches cannot
    resume under another count: refused."""
    micro_step = int(state["micro_step"])
    saved = int(state.get("grad_accumulation_steps", accumulation))
    if saved == accumulation:
        return micro_step
    if micro_step % saved:
        raise ValueError(
            f"This plan state was saved after micro-batch {micro_step % saved} of a step of "
            f"{saved}; it cannot resume under grad_accumulation_steps={accumulation}. Save "
            "the checkpoint after plan.step() returned True (at a step boundary)."
        )
    return micro_step // saved * accumulation


class PrecisionPlan:
    """A model and optimizer set up for one precision mode, and the training-step verbs.

    Attributes:
        model: the model to train (converted in place: the object you passed).
        optimizer: the optimizer to step (rebuilt when the mode needs another implementation).
        mode: the :class:`~autoprec.modes.PrecisionMode` doing the work.
    """

    def __init__(
        self,
        mode: PrecisionMode,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        grad_accumulation_steps: int = 1,
        clip_grad_norm: float | None = None,
    ) -> None:
        check_step_settings(grad_accumulation_steps, clip_grad_norm)
        self.mode = mode
        mode.configure_accumulation(grad_accumulation_steps)
        self.model = model
        self.optimizer = optimizer
        self.grad_accumulation_steps = grad_accumulation_steps
        self.clip_grad_norm = clip_grad_norm
        self.micro_step = 0
        self._awaiting_last_backward = False
        """plan.step() closed a micro-batch before the step's last, whose backward has not run
        (``clip_gradients`` then reads partial sums: found by a hunt)."""
        self._holds_checked = False  # whether a step found the optimizer holds the model's
        if mode.keeps_gradient_state():  # sums beside .grad, amp_fp16's unscale of them
            _zero_grad_tells_mode(optimizer, mode)
        self.last_grad_norm: torch.Tensor | None = None
        """The total gradient norm before the last clipping, on the device (reading it is a
        host synchronization: do it when you log, not every step)."""
        self.proven_clip: tuple[float | None] | None = None
        """``(clip_grad_norm,)`` of the recipe the profile was proven under, set by
        ``Profile.apply``: a ``step(clip_grad_norm=...)`` that differs warns once, as
        ``apply()`` warns for its own arguments (a loop clipping at ``plan.step`` was never
        compared). None: no proven recipe to compare with."""
        self.scheduler: Any = None
        """The LR scheduler handed to ``prepare``/``apply``, rebound to ``optimizer``; the
        training loop steps it as before (the plan never does)."""

    @property
    def spec(self) -> ModeSpec:
        return self.mode.spec

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Context for the forward pass (and the loss): the mode's precision."""
        self._refuse_a_moved_model()
        return self.mode.forward_context()

    def _refuse_a_moved_model(self) -> None:
        """The mode set autocast (and fp16's loss scaler) up for the device the model was on
        at ``apply()``: a model moved afterwards (``apply()`` then ``.cuda()``) would run its
        CUDA ops outside a CPU autocast, in fp32, without a word (found by a hunt)."""
        if self.mode.name in ("fp32", "tf32"):
            return
        parameter = next(iter(self.model.parameters()), None)
        if parameter is not None and parameter.device.type != self.mode.device_type:
            raise RuntimeError(
                f"The model is on {parameter.device} but this {self.mode.spec.label} plan was "
                f"set up for {self.mode.device_type} (the model's device at apply()): its "
                "autocast and loss scaling would not reach the model. Move the model to its "
                "device before apply() (or prepare())."
            )

    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass; the loss is divided by ``grad_accumulation_steps`` and scaled if the
        mode uses loss scaling."""
        if self.grad_accumulation_steps > 1:
            loss = loss / self.grad_accumulation_steps
        self.mode.backward(loss)
        if (self.micro_step + 1) % self.grad_accumulation_steps == 0:
            self._awaiting_last_backward = False
            self.mode.gradients_ready()  # the step's last micro-batch: whole gradients in .grad

    def step(
        self, loss: torch.Tensor | None = None, *, clip_grad_norm: float | None = None
    ) -> bool:
        """Finish a micro-batch: backward (if ``loss`` is given), then every
        ``grad_accumulation_steps`` micro-batches unscale, clip (``clip_grad_norm``, None: the
        plan's own; ``math.inf``: measure only), step, update the scaler and zero the
        gradients.

        Returns:
            True when the optimizer stepped; False on accumulation micro-batches and when the
            loss scaler skipped a step after inf/nan gradients.
        """
        check_step_settings(1, clip_grad_norm)  # before any work: 0 freezes, < 0 steps uphill
        if loss is not None:
            self.backward(loss)
        self.micro_step += 1
        if self.micro_step % self.grad_accumulation_steps:
            self._awaiting_last_backward = (self.micro_step + 1) % self.grad_accumulation_steps == 0
            return False
        clip = clip_grad_norm if clip_grad_norm is not None else self.clip_grad_norm
        if clip_grad_norm is not None and self.proven_clip is not None:
            self._compare_with_proven_clip(clip_grad_norm)
        if clip is not None:
            self.clip_step_gradients(clip)
        stepped = self.mode.optimizer_step(self.optimizer)
        if not self._holds_checked:
            self._holds_checked = _refuse_detached_optimizer(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return stepped

    def _compare_with_proven_clip(self, clip: float) -> None:
        """Warn once when a step's clip is not the proven recipe's (``math.inf``, measure only,
        is no clipping): every step is compared until one differs."""
        (proven,) = self.proven_clip or (None,)
        if (math.inf if proven is None else proven) != clip:
            self.proven_clip = None  # once
            warn_caller(
                f"This {self.spec.label} profile was proven under another training recipe: "
                f"clip_grad_norm: proven at {proven}"
                f"{' (no clipping)' if proven is None else ''}, applied with {clip} at "
                "plan.step. Its drift evidence does not cover this recipe; run `autoprec "
                "tune` (or `autoprec check`) with it.",
                RecipeMismatchWarning,
            )

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Unscale the gradients (fp16) and clip them to ``max_norm`` (inf: measure only);
        the norm before clipping, also kept as ``last_grad_norm`` (a device tensor). Call it
        after the backward of a step's last micro-batch (with accumulation, the gradients
        before it are partial sums: loss-scaled under amp_fp16, held apart in fp32 under pure
        bf16), as torch's GradScaler allows one unscale per step."""
        if (self.micro_step + 1) % self.grad_accumulation_steps or self._awaiting_last_backward:
            position = (self.micro_step - self._awaiting_last_backward) % (
                self.grad_accumulation_steps
            ) + 1
            raise RuntimeError(
                f"clip_gradients was called after micro-batch {position} of "
                f"{self.grad_accumulation_steps}: the gradients are partial until the step's "
                "last backward (and unscaling them now would leave the rest of the step "
                "loss-scaled under amp_fp16). Call it after the last micro-batch's backward, "
                "or pass clip_grad_norm to prepare()/apply() and let plan.step clip."
            )
        return self.clip_step_gradients(max_norm)

    def clip_step_gradients(self, max_norm: float) -> torch.Tensor:
        """:meth:`clip_gradients` without its accumulation check, for a trainer that counts
        micro-batches itself and calls this only at a step's end (the HF Trainer's)."""
        self.mode.unscale_gradients(self.optimizer)
        parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in parameters if p.grad is not None]
        if any(grad.is_sparse for grad in grads):
            self.last_grad_norm = _clip_with_sparse(grads, max_norm)
        else:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return self.last_grad_norm

    def state_dict(self) -> dict[str, Any]:
        """Mode state (loss scaler, step counters) for checkpoints; save it next to the model's
        and the optimizer's state dicts."""
        return {
            "spec": self.spec.model_dump(mode="json"),
            "mode": self.mode.state_dict(),
            "micro_step": self.micro_step,
            "grad_accumulation_steps": self.grad_accumulation_steps,
        }

    def checked_state(self, state: dict[str, Any]) -> tuple[ModeSpec, int]:
        """(the spec a plan state was saved under, the micro-batch it resumes at), or the
        ValueError :meth:`load_state_dict` would raise for it, loading nothing (not what
        ``state_dict()`` returns; saved mid-step under another accumulation)."""
        if not isinstance(state, dict) or not set(state) >= PLAN_STATE_KEYS:
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                "plan.load_state_dict takes what plan.state_dict() returned (keys "
                f"{', '.join(sorted(PLAN_STATE_KEYS))}) but got {found}. Load a model's state "
                "with plan.model.load_state_dict and an optimizer's with "
                "plan.optimizer.load_state_dict."
            )
        saved = ModeSpec.model_validate(state["spec"])
        return saved, _resumed_micro_step(state, self.grad_accumulation_steps)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. A plan of the same mode (other knobs, say
        ``keep_fp32``) takes the mode's state (the loss scale); one of another mode resumes the
        run in its own precision from here, its mode's state fresh, with a warning."""
        saved, micro_step = self.checked_state(state)  # a refusal loads nothing
        if saved.mode == self.spec.mode:
            self.mode.load_state_dict(state["mode"])
        else:
            carried = ", ".join(sorted(state["mode"])) or "nothing"
            warn_caller(
                f"This checkpoint was written by a plan for {saved.label}; resuming it under "
                f"{self.spec.label} switches the run's precision here. {saved.mode}'s own state "
                f"({carried}) does not carry over: {self.spec.mode} starts its own. The model's "
                "and the optimizer's states load as usual (plan.optimizer reads another mode's "
                "optimizer state).",
                PrecisionSwitchWarning,
            )
        self.micro_step = micro_step

    def __repr__(self) -> str:
        return f"PrecisionPlan({self.spec.label}, optimizer={type(self.optimizer).__name__})"


def _refuse_detached_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """At the first step whose backward reached the model's weights: refused when the
    optimizer holds none of them. A wrapper that replaces the parameters after ``apply()``
    (FSDP2's ``fully_shard``) left ``plan.optimizer`` stepping tensors the model no longer
    used: every step "succeeded" and nothing trained (found by a hunt). True once checked."""
    with_grads = [p for p in model.parameters() if p.grad is not None]
    if not with_grads:
        return False  # nothing reached the model yet (or a mode keeps its sums): next step
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if any(id(p) in held for p in with_grads):
        return True
    raise RuntimeError(
        f"The optimizer holds none of the {len(with_grads)} model parameters the backward "
        "gave gradients to: it steps tensors the model no longer uses, and nothing would "
        "train. Something replaced the model's parameters after apply()/prepare() "
        "(FSDP2's fully_shard does: shard the model first and apply the profile to the "
        "sharded model only where its route is documented, or build the optimizer over "
        "model.parameters() after the wrapper and apply the profile with it)."
    )


def _clip_with_sparse(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over gradients some of which are sparse (an
    ``nn.Embedding(sparse=True)``), which it cannot take ("Could not run ... SparseCPU": any
    clip_grad_norm failed in every mode, found by a hunt): the same norm over the values each
    stores, the same clip coefficient."""
    norms = [torch.linalg.vector_norm(stored_values(grad).float()) for grad in grads]
    total = torch.linalg.vector_norm(torch.stack([norm.to(norms[0].device) for norm in norms]))
    coefficient = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for grad in grads:
        grad.mul_(coefficient)
    return total


def compile_model(model: nn.Module) -> None:
    """``torch.compile`` the converted model's forward in place, with inductor's defaults, as a
    user compiling their model does: the same object, the same state_dict keys (no
    ``_orig_mod.`` prefix). Compilation happens on the first forward pass; errors surface
    there. (``nn.Module.compile()`` is not used: in torch 2.13 it silently runs eager when the
    root module's class is torch's own, an ``nn.Sequential``; the forward is what it must
    compile.) A deep copy of the model compiles its own forward (:class:`CompiledForward`)."""
    model.forward = CompiledForward(model, vars(model).get("forward"))  # type: ignore[method-assign]


def build_plan(
    spec: ModeSpec,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    grad_accumulation_steps: int = 1,
    clip_grad_norm: float | None = None,
    situation: Situation | None = None,
    compiled_by_user: bool = False,
) -> PrecisionPlan:
    """:func:`prepare` without a scheduler to rebind and without warnings (trials use it);
    ``compiled_by_user``: ``model`` runs inside the user's ``torch.compile`` wrapper, which a
    compiled spec does not compile again."""
    check_model_and_optimizer(model, optimizer)
    _refuse_non_spec(spec)
    mode = mode_for(spec)
    situations = [situation] if situation else situations_for_model(model, emulate_fp8=spec.emulate)
    reasons = list(dict.fromkeys(r for each in situations for r in mode.requirements(each)))
    if reasons:
        listed = "".join(f"\n  - {reason}" for reason in reasons)
        raise UnsupportedModeError(
            f"{spec.label} cannot run here:{listed}\nRun `autoprec probe` to see what can.",
            tuple(reasons),
        )
    # refuse before converting anything: a refusal leaves the model and optimizer untouched
    check_step_settings(grad_accumulation_steps, clip_grad_norm)
    _refuse_kept_low_precision(mode, model)
    _refuse_sharded_casts(spec, model)
    uncalled = uncalled_kept_module(model, mode.keeps_fp32)
    if uncalled:
        raise ValueError(uncalled)
    _refuse_unknown_names(spec, model)
    mode.check_optimizer(optimizer)
    groups = named_groups(optimizer, model)
    model = _converted(mode, model)
    optimizer = mode.convert_optimizer(optimizer, model, groups)
    if spec.compile and not compiled_by_user:
        compile_model(model)
    if _changes_the_model(mode, spec, compiled_by_user):
        for module in model.modules():
            module.__dict__[CONVERTED_MARK] = spec.label
    return PrecisionPlan(
        mode,
        model,
        optimizer,
        grad_accumulation_steps=grad_accumulation_steps,
        clip_grad_norm=clip_grad_norm,
    )


_CASTS_OR_SWAPS = ("bf16_pure", "bf16_sr", "bf16_kahan", "bf16_sr_kahan", "fp8_torchao", "fp8_te")
"""Modes that cast the weights or swap modules: what FSDP2 recorded of a sharded model (and
8-bit states, whose bitsandbytes kernels have no sharding strategy: found by a review)."""


def _refuse_sharded_casts(spec: ModeSpec, model: nn.Module) -> None:
    """A model FSDP2 already sharded (DTensor parameters), under a mode that casts weights or
    swaps modules: FSDP2 recorded the dtypes and modules it sharded, and the first forward
    failed in torch ("mat1 and mat2 must have the same dtype"; found by a hunt)."""
    if spec.mode not in _CASTS_OR_SWAPS and spec.optimizer_bits != 8:
        return
    if not any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return
    raise UnsupportedModeError(
        f"The model is sharded (DTensor parameters: FSDP2's fully_shard, or tensor "
        f"parallelism), and {spec.label} casts its weights, swaps its modules or keeps its "
        "optimizer state in bitsandbytes' kernels, none of which a sharded model takes "
        "(FSDP2 recorded the dtypes and modules it sharded). Sharded, use fp32, tf32, "
        "amp_bf16 or amp_fp16 without 8-bit states (shard first, then prepare()/apply()); "
        "train this mode under DDP.",
        (f"{spec.label} on a sharded model (found: DTensor parameters)",),
    )


def _refuse_non_spec(spec: Any) -> None:
    if not isinstance(spec, ModeSpec):
        raise TypeError(
            f"spec must be an autoprec.ModeSpec, e.g. ModeSpec(mode='amp_bf16'), but got "
            f"{type(spec).__name__} {spec!r}."
        )


def _refuse_unknown_names(spec: ModeSpec, model: nn.Module) -> None:
    """A ``keep_fp32`` or ``fp8_skip`` pattern naming a module by its second name only, or
    naming no module (a typo), kept nothing, silently: tune refused both; prepare() ran the
    module in bf16 or FP8 (found by hunts). ``Profile.apply`` warns of a profile's patterns
    this model lacks and leaves them out before it gets here."""
    for field in ("keep_fp32", "fp8_skip"):
        for pattern in getattr(spec, field):
            refusal = unknown_name_refusal(model, pattern, field)
            if refusal:
                raise ValueError(refusal)


def _refuse_kept_low_precision(mode: PrecisionMode, model: nn.Module) -> None:
    """A ``keep_fp32`` module whose weights are all loaded in low precision (a frozen bf16
    base): its fp32 island failed at the first forward with torch's "mixed dtype" error."""
    for fqn in mode.kept_roots(model):
        module = model.get_submodule(fqn)
        if loaded_in_low_precision(module):
            dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
            raise ValueError(
                f"keep_fp32 keeps {fqn!r} in fp32, but its weights are all {dtype} (frozen, "
                "loaded in low precision): there are no fp32 weights to keep, and an fp32 "
                f"island cannot compute with them. Leave {fqn!r} out of keep_fp32 (it computes "
                f"as loaded), or load it in fp32 first (model.{fqn}.float())."
            )


def _converted(mode: PrecisionMode, model: nn.Module) -> nn.Module:
    """``mode.convert_module(model)`` with the model's leftover gradients dropped first.

    A run switched mid-way in the usual loop order (zero_grad, backward, step) still holds the
    last step's fp32 gradients: a bf16 mode's first step failed on them ("expected dtype
    BFloat16"), and the others added them into the next step's gradient (a cosine of 0.978 to
    fp32's own next step instead of 1.000). That step has applied them; the next makes its own.
    A conversion that refuses (FP8 with no layer to run in FP8) gives them back: the refusal
    deleted them (found by a hunt)."""
    leftover = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    for parameter, _ in leftover:
        parameter.grad = None
    try:
        return mode.convert_module(model)
    except Exception:
        for parameter, gradient in leftover:
            parameter.grad = gradient
        raise


def _schedulers(scheduler: Any) -> list[Any]:
    """A scheduler and those it drives (SequentialLR, ChainedScheduler), depth first."""
    found = [scheduler]
    for inner in getattr(scheduler, "_schedulers", None) or []:
        found.extend(_schedulers(inner))
    return found


def _track_step_calls(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` as an LRScheduler does, so torch's order check keeps working."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    function = step.__func__  # type: ignore[attr-defined]
    reference = weakref.ref(optimizer)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        target = reference()
        target._opt_called = True  # type: ignore[union-attr]
        return function.__get__(target, type(target))(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def _rebind_scheduler(
    scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer
) -> None:
    """Make ``scheduler`` (checked to drive ``old``) drive ``new``: same schedule, same
    position. The new optimizer's groups already hold the scheduled lrs and ``initial_lr``
    (the rebuild copies every group option), so only the scheduler's references change."""
    for inner in _schedulers(scheduler):
        inner.optimizer = new
    _track_step_calls(new)
    new._opt_called = getattr(old, "_opt_called", False)  # type: ignore[attr-defined]


def _refuse_islands_under_fullgraph(spec: ModeSpec, model: nn.Module, inner: nn.Module) -> None:
    """``torch.compile(..., fullgraph=True)`` cannot run the fp32 islands of kept modules
    (their hooks leave the graph on purpose): the first forward failed inside dynamo with a
    hint to remove autoprec's own ``torch.compiler.disable`` (found by a hunt). Read from a
    ``torch.compile(model)`` wrapper, and from ``module.compile(fullgraph=True)`` on the model
    or a module holding a kept one (missed until a later hunt), or a wrapped submodule."""
    if not isinstance(spec, ModeSpec) or spec.mode in ("fp32", "tf32"):
        return  # build_plan refuses what is no ModeSpec
    scopes = [""] if _fullgraph(getattr(model, "dynamo_ctx", None)) else []
    scopes += [fqn for fqn, module in inner.named_modules() if _compiled_fullgraph(module)]
    roots = mode_for(spec).kept_roots(inner)
    inside = [
        root
        for root in roots
        if any(not scope or root == scope or root.startswith(scope + ".") for scope in scopes)
    ]
    if not inside:
        return
    where = "the model" if "" in scopes else first_names([repr(scope) for scope in scopes], 3)
    raise ValueError(
        f"{spec.label} keeps {first_names(inside, 4)} in fp32 through hooks that run outside "
        f"the compiled graph, and {where} is compiled with fullgraph=True, which refuses them. "
        "Compile without fullgraph=True, or use a profile that keeps nothing in fp32."
    )


def _compiled_fullgraph(module: nn.Module) -> bool:
    """Is ``module`` a ``torch.compile`` wrapper or compiled in place (``module.compile()``),
    with ``fullgraph=True``?"""
    if _fullgraph(getattr(module, "dynamo_ctx", None)):
        return True
    compiled = getattr(module, "_compiled_call_impl", None)
    if compiled is None:
        return False
    try:  # torch.compile(fn) closes over its OptimizeContext, which holds fullgraph
        context = inspect.getclosurevars(compiled).nonlocals.get("self")
    except (TypeError, ValueError):
        return False
    return _fullgraph(context)


def _fullgraph(context: Any) -> bool:
    return getattr(context, "fullgraph", False) is True


def prepare(
    spec: ModeSpec,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    grad_accumulation_steps: int = 1,
    clip_grad_norm: float | None = None,
    situation: Situation | None = None,
) -> PrecisionPlan:
    """Set ``model`` and ``optimizer`` up for ``spec`` and return the plan to train with.

    The model is converted in place (casts, module swaps, hooks); the optimizer is rebuilt when
    the mode needs another implementation, with the same groups and hyper-parameters, and the
    ``scheduler`` built on it is rebound to ``plan.optimizer`` (``plan.scheduler``), so its lr
    follows the schedule in every mode. Call it before training starts (and before loading
    optimizer checkpoints), or mid-run: an optimizer that has stepped keeps its state in
    ``plan.optimizer`` (``PrecisionMode.convert_optimizer``). A ``torch.compile(model)``
    wrapper: the model inside it is converted (``keep_fp32`` names as tune saw them), and
    ``plan.model`` is the wrapper, never compiled a second time.

    Raises:
        UnsupportedModeError: the mode cannot run here; the message lists every reason. No
            other mode is ever substituted.
        ValueError: the model's trainable weights are not all fp32 (every mode starts from
            fp32 weights: AMP on bf16 weights would train as pure bf16).

    Warns:
        OptimizerRebuiltWarning: the optimizer was rebuilt and no scheduler was passed: a
            scheduler built on your optimizer would keep driving the old one.
    """
    _refuse_non_spec(spec)  # first: the refusals below name it (found by a hunt: a string
    # spec for a bf16 model gave "'str' object has no attribute 'label'")
    check_model_and_optimizer(model, optimizer)  # before anything reads them (a list, None,
    # or the two swapped gave AttributeError: found by a hunt)
    _refuse_unfit(spec, model, optimizer, scheduler)
    inner = inside_compile_wrapper(model)  # torch.compile(model): convert the model inside
    _refuse_islands_under_fullgraph(spec, model, model if inner is None else inner)
    plan = build_plan(
        spec,
        model if inner is None else inner,
        optimizer,
        grad_accumulation_steps=grad_accumulation_steps,
        clip_grad_norm=clip_grad_norm,
        situation=situation,
        compiled_by_user=inner is not None,
    )
    if inner is not None:
        plan.model = model  # the wrapper, which runs the converted model compiled
    _attach_scheduler(plan, spec, optimizer, scheduler)
    _warn_outside_optimizer(plan)
    return plan


def _refuse_unfit(
    spec: ModeSpec, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> None:
    """Refuse, before converting anything: a model autoprec already converted, weights not
    all fp32, a scheduler that drives another optimizer."""
    found = non_fp32_weights(model) if isinstance(model, nn.Module) else None
    converted = _converted_for(model)
    if converted is not None:
        # fp32-weight modes too: a second amp conversion stacked a second fp32 island on each
        # keep_fp32 module, whose exit left autocast off for the rest of the forward
        weights = f"found {found}" if found is not None else "its weights are still fp32"
        raise ValueError(
            f"This model was already converted by autoprec for {converted} (apply() or "
            f"prepare() ran on it; {weights}), and a converted model is not converted again: "
            "its first mode's hooks, module swaps and casts stay (model.float() would keep "
            "them). Keep training with the plan you have; to change mode or start another "
            "run, load your fp32 weights (or the converted model's state_dict(), cast with "
            ".float()) into a freshly built model and apply the profile to that."
        )
    if found is not None:
        raise ValueError(
            f"{spec.label} needs the model's weights in fp32: every mode starts from fp32 "
            f"weights, and a profile was proven from them. Found {found}. Kept as they are, "
            "they would train in their own dtype under this mode's name (bf16 weights as pure "
            "bf16 with nearest rounding under AMP), and keep_fp32 modules would not be fp32. "
            f"{fp32_fix(model)}"
        )
    if scheduler is not None:
        for inner in _schedulers(scheduler):  # check before converting anything
            if getattr(inner, "optimizer", None) is not optimizer:
                raise ValueError(
                    f"The scheduler ({type(inner).__name__}) does not drive the optimizer passed "
                    "to apply(): build it on that optimizer, or pass scheduler=None."
                )


def _attach_scheduler(
    plan: PrecisionPlan, spec: ModeSpec, optimizer: torch.optim.Optimizer, scheduler: Any
) -> None:
    """Rebind the user's scheduler to ``plan.optimizer`` when the mode rebuilt it; without one,
    warn that a scheduler built on the old optimizer would drive an optimizer nobody steps."""
    if scheduler is not None:
        if plan.optimizer is not optimizer:
            _rebind_scheduler(scheduler, optimizer, plan.optimizer)
        plan.scheduler = scheduler
        return
    if plan.optimizer is not optimizer:
        scheduled = any("initial_lr" in group for group in optimizer.param_groups)
        found = (
            " Your optimizer's groups carry initial_lr, so a scheduler was built on it: it now "
            "drives an optimizer nobody steps."
            if scheduled
            else ""
        )
        warn_caller(
            f"{spec.label} rebuilt the optimizer as plan.optimizer "
            f"({type(plan.optimizer).__name__}).{found} Pass your LR scheduler to "
            "apply(model, optimizer, scheduler) to rebind it, or build schedulers on "
            "plan.optimizer.",
            OptimizerRebuiltWarning,
        )


def _warn_outside_optimizer(plan: PrecisionPlan) -> None:
    """Trainable weights ``plan.optimizer`` does not hold, which another optimizer (Muon for
    the matrices beside AdamW, SparseAdam for an embedding) steps: a pure-bf16 mode cast them,
    and that optimizer rounds their updates to nearest (found by a hunt: under bf16_sr and
    bf16_kahan such a weight kept about 10% of its fp32 movement over 20 steps); under
    amp_fp16 their gradients arrive multiplied by the loss scale, which only plan.optimizer's
    are divided by (another hunt: a gradient norm of 28316 for 0.43). Nothing said so."""
    held = {id(p) for group in plan.optimizer.param_groups for p in group["params"]}
    scaled = plan.mode.spec.mode == "amp_fp16"
    outside = [
        name
        for name, parameter in plan.model.named_parameters()
        if parameter.requires_grad
        and (scaled or parameter.dtype in (torch.bfloat16, torch.float16))
        and id(parameter) not in held
    ]
    if not outside:
        return
    shown = ", ".join(outside[:3]) + (f" and {len(outside) - 3} more" if len(outside) > 3 else "")
    if scaled:
        warn_caller(
            f"amp_fp16 scales the loss, and only plan.optimizer's gradients are unscaled: "
            f"{len(outside)} trainable weight(s) it does not hold ({shown}) get gradients "
            f"multiplied by the loss scale (2**16 at the start), and a step the scaler skips "
            "for an overflow is not skipped for them. Step them with plan.optimizer (a group "
            "added later with plan.optimizer.add_param_group is stepped as the mode steps), "
            "or use amp_bf16, which scales nothing.",
            OutsideOptimizerWarning,
        )
        return
    warn_caller(
        f"{plan.mode.spec.label} cast {len(outside)} trainable weight(s) that plan.optimizer "
        f"does not hold to bf16 ({shown}): another optimizer stepping them rounds every update "
        "to nearest, and updates below half a bf16 ulp vanish. Keep their modules in fp32 "
        "(the profile's keep_fp32), or step them with plan.optimizer (a group added later "
        "with plan.optimizer.add_param_group is stepped as the mode steps).",
        OutsideOptimizerWarning,
    )
