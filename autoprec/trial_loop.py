"""A trial's training loop: optimizer steps run as ``apply()`` runs them, timed in windows with
no host read inside one, leg by leg at the recipe's learning rates; the held-out pass after."""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from autoprec.batching import (
    EvalFn,
    LossFn,
    TrainStep,
    count_batch,
    forward_and_loss,
    prediction,
    tensors_in,
    to_device,
)
from autoprec.buffer_slots import (
    buffer_slots,
    empty_buffer_slots,
    kept_values,
    restore_buffer_slots,
)
from autoprec.interrupts import raise_if_interrupted
from autoprec.layer_flops import NEEDS_GRADIENTS
from autoprec.model_copies import compiled_in_place, inside_compile_wrapper
from autoprec.plan import PrecisionPlan
from autoprec.random_streams import cuda_devices_of, kept_streams, set_streams, stream_states
from autoprec.recipe import LrPoint, TrainingRecipe, set_group_momentum
from autoprec.trial_failures import EvalFnError, StopCheckRaised, first_line
from autoprec.trial_measures import (
    SavedForBackward,
    WindowClock,
    compiled_graph_count,
    low_precision_moment,
    max_abs_gradient,
    nearest_adam_beta2,
    nearest_rounded_decay,
    outside_state,
    rss_bytes,
    sampled_weights,
    state_bytes,
    state_no_optimizer_steps,
    torch_settings_kept,
)
from autoprec.trial_records import (
    OutputSummary,
    StepWindow,
    StopCheck,
    TrialFailure,
    TrialProgress,
    TrialResult,
    summarize_output,
)

MAX_WINDOW_STEPS = 10
"""Most optimizer steps timed as one window. A window ends in one host read, as a loop that
logs its loss every 10 steps does (torchtitan's default ``log_freq``); longer windows would
measure CPU/GPU overlap no better and give fewer windows to take a median over."""

MIN_WINDOWS = 5
"""Fewest measured windows a trial aims for: shorter trials time shorter windows."""


_T = TypeVar("_T")

_HOOKS_REFUSED = "support saved tensor hooks"
"""torch.func's refusal of saved-tensor hooks ("torch.func.{grad, vjp, jacrev, hessian} don't
yet support saved tensor hooks")."""


def window_steps_for(steps: int, warmup_steps: int) -> int:
    """Steps per timed window: at most MAX_WINDOW_STEPS, and short enough for MIN_WINDOWS
    windows after warm-up."""
    return max(1, min(MAX_WINDOW_STEPS, (steps - warmup_steps) // MIN_WINDOWS))


def heldout_pass(
    plan: PrecisionPlan,
    heldout: Sequence[Any],
    device: torch.device,
    loss_fn: LossFn | None,
    train_step: TrainStep | None,
) -> tuple[list[float], list[OutputSummary | None], ActivationRange]:
    """(loss per batch, output summary per batch, the range of the outputs of the leaf modules
    not kept in fp32) over ``heldout`` in eval mode, no gradients, under the plan's autocast:
    the range the fp16 check reads. Under ``train_step`` the output is what the model returned
    to it, when it called the model once for the batch (a hook on the model; None otherwise).

    A compiled model gives its losses and outputs whole-graph, and its range in a second pass
    run eagerly (``torch.compiler.set_stance("force_eager")``): a hook on every leaf breaks the
    graph at each one, and dynamo compiled every leaf's forward again per instance (a 4-layer
    TinyGPT: 14 graphs for the training's 1; on a 17-Linear model the recompile limit).

    With gradients where a ``train_step`` runs (it may differentiate by its inputs), and where
    the model's forward does (forces as -dE/dpos, ``torch.autograd.grad`` in ``forward``):
    without them it raised "does not have a grad_fn", and the trial was reported as a loss
    without gradients at its last step (found by a hunt). Such a pass runs again with
    gradients, from the same random streams; nothing is stepped."""
    if train_step is not None:
        return _pass(_HeldoutPass(plan, heldout, device, loss_fn, train_step, grad=True))
    return with_gradients_if_needed(
        device, lambda grad: _pass(_HeldoutPass(plan, heldout, device, loss_fn, None, grad))
    )


def with_gradients_if_needed(device: torch.device, run: Callable[[bool], _T]) -> _T:
    """``run(False)`` (without gradients); where that raised "does not have a grad_fn" (a
    forward that differentiates by its inputs: forces as -dE/dpos), ``run(True)`` from the
    same random streams. The held-out pass and ``eval_fn`` run so; nothing is stepped."""
    drawn = stream_states(device)
    try:
        return run(False)
    except (RuntimeError, EvalFnError) as error:
        if NEEDS_GRADIENTS not in str(error):
            raise
    set_streams(device, drawn)
    return run(True)


class _HeldoutPass(NamedTuple):
    """What a held-out pass runs on, and whether with gradients."""

    plan: PrecisionPlan
    heldout: Sequence[Any]
    device: torch.device
    loss_fn: LossFn | None
    train_step: TrainStep | None
    grad: bool


def _pass(on: _HeldoutPass) -> tuple[list[float], list[OutputSummary | None], ActivationRange]:
    """:func:`heldout_pass`, with or without gradients."""
    if not _runs_compiled(on.plan):
        return _evaluate(on, watch_range=True)
    losses, outputs, _ = _evaluate(on, watch_range=False)
    # its random draws (a train_step's, a diffusion loss's noise) put back: what follows
    # (eval_fn) draws as it would after one pass
    with kept_streams(cuda_devices_of(on.device)), torch.compiler.set_stance("force_eager"):
        _, _, watched = _evaluate(on, watch_range=True)
    return losses, outputs, watched


def _runs_compiled(plan: PrecisionPlan) -> bool:
    """Does the plan's model run ``torch.compile``d (the plan's, the user's wrapper, or a
    submodule compiled in place)?"""
    model = plan.model
    return (
        plan.spec.compile or inside_compile_wrapper(model) is not None or compiled_in_place(model)
    )


def _evaluate(
    on: _HeldoutPass, watch_range: bool
) -> tuple[list[float], list[OutputSummary | None], ActivationRange]:
    """One held-out pass (see :func:`heldout_pass`); the range is empty unless ``watch_range``."""
    plan, heldout, device, loss_fn, train_step, grad = on
    ranges = _RangeWatch(plan, watch_range)
    returned: list[Any] = []  # what the model returned to train_step, call by call
    handles = ranges.attach()
    if train_step is not None:
        keep = torch.compiler.disable(_returned_into(returned))
        handles.append(plan.model.register_forward_hook(keep))
    # a train_step or forward may differentiate by its inputs (a physics-informed loss:
    # autograd.grad of the output by x). Nothing is stepped: the graph goes with the loss.
    grad_mode = torch.enable_grad() if grad else torch.no_grad()
    losses, outputs = [], []
    try:
        with _eval_mode(plan.model), grad_mode, plan.autocast(), ranges.inside():
            for batch in heldout:
                returned.clear()
                loss, output = forward_and_loss(plan, to_device(batch, device), loss_fn, train_step)
                losses.append(float(loss.detach().float()))
                if len(returned) == 1:  # one call: its output; more (a teacher, CFG): ambiguous
                    output = returned.pop()
                predicted = prediction(output)
                outputs.append(None if predicted is None else summarize_output(predicted))
    finally:
        for handle in handles:
            handle.remove()
    return losses, outputs, ranges.reading()


def _returned_into(returned: list[Any]) -> Callable[[nn.Module, Any, Any], None]:
    """A forward hook keeping what the model returns to a ``train_step`` in ``returned``, but
    not a call under torch.vmap or torch.func (a residual per point): its output is the
    transform's wrapper, and reducing it after the transform raised (a review)."""

    def keep_returned(_module: nn.Module, _args: Any, output: Any) -> None:
        if torch._C._functorch.maybe_current_level() is None:
            returned.append(output)

    return keep_returned


ROW_CONSTANT_TOLERANCE = 1e-2
"""How near zero the rows' gradient sums must be for the loss to ignore a constant added to a
row: the L2 norm over the batch of each row's sum, against that of each row's summed
|gradient|. Measured on 64 rows of 10 classes (fp32): softmax cross-entropy 5e-8 to 1.5e-7
from a loss of 1.1 down to 0.05 (label smoothing and a KL to soft targets alike), CE with a
1e-4 z-loss 4e-4 (it barely sees the constant); BCE 0.33-1.0, MSE 0.40, a CORAL ordinal head
0.62-0.96, CE plus 0.1 MSE on the logits 0.048. Per row, as first written, a row the model is
sure of (p 0.9999) read 3e-4 from fp32 rounding alone, and a trained tagger's reference read
False (a review). Where every row is that sure (a held-out loss near 1e-5) it reads False,
and the outputs are compared as they are."""


def ignores_row_constants(
    plan: PrecisionPlan,
    batch: Any,
    device: torch.device,
    loss_fn: LossFn | None,
    train_step: TrainStep | None,
) -> bool | None:
    """Does the loss ignore a constant added to a row of the prediction (over its last
    dimension), read on one held-out batch: the rows of its gradient by the prediction sum
    to zero (``ROW_CONSTANT_TOLERANCE``), as softmax cross-entropy's, log-softmax's and a
    CRF's do. The output check
    forgives such a constant only then: forgiven for any output, an ordinal (CORAL) head,
    whose input-dependent part is all in the row's mean, passed pure bf16 2000-step runs
    found 57% worse (a hunt). None where no prediction with a class dimension reaches the
    loss. Eval mode, the random streams put back, nothing stepped."""
    returned: list[Any] = []
    keep = _returned_into(returned)
    handle = plan.model.register_forward_hook(keep) if train_step is not None else None
    try:
        with _eval_mode(plan.model), torch.enable_grad(), kept_streams(cuda_devices_of(device)):
            loss, output = forward_and_loss(plan, to_device(batch, device), loss_fn, train_step)
            predicted = prediction(returned[0] if len(returned) == 1 else output)
            if (
                predicted is None
                or predicted.dim() < 2
                or predicted.shape[-1] < 2
                or not (predicted.requires_grad and loss.requires_grad)
            ):
                return None
            (grad,) = torch.autograd.grad(loss, predicted, allow_unused=True)
    finally:
        if handle is not None:
            handle.remove()
    if grad is None:
        return None
    rows = grad.detach().reshape(-1, grad.shape[-1]).double()
    spread = float(rows.abs().sum(-1).norm())
    return spread > 0 and float(rows.sum(-1).norm()) <= ROW_CONSTANT_TOLERANCE * spread


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode without torch's fused attention fast path, as it was after.
    nn.MultiheadAttention / TransformerEncoder take that path in eval mode without grad in
    fp32 only (autocast turns it off): padded rows come out 0 in fp32 and not in the mode, and
    its nested tensors have no max. Training never takes it; neither does the held-out pass."""
    was_training = model.training
    fastpath = torch.backends.mha.get_fastpath_enabled()
    model.eval()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        model.train(was_training)


class _RangeWatch:
    """The largest finite |value| and the infinities of the mode's leaf modules' outputs in a
    held-out pass, and under amp_fp16 of every op's fp16 output (:class:`_Fp16Watch`), kept
    on the device and read once at the end: no device sync per layer. Watches nothing unless
    ``on``."""

    def __init__(self, plan: PrecisionPlan, on: bool) -> None:
        self.leaves = {  # modules kept in fp32 run in fp32: their range is not the mode's
            module: fqn
            for fqn, module in plan.model.named_modules()
            if on and next(module.children(), None) is None and not plan.mode.keeps_fp32(fqn)
        }
        # only amp_fp16 computes in fp16: every other run would pay the per-op reads for nothing
        self.fp16 = on and plan.spec.mode == "amp_fp16"
        self.maxima: list[torch.Tensor] = []
        self.infinite: list[torch.Tensor] = []
        self.called: list[str] = []  # the leaf of each entry of ``infinite``

    def _watch(self, module: nn.Module, _args: Any, output: Any) -> None:
        for tensor in tensors_in(output):  # a leaf may return (y, aux) or a dict
            parts = tensor.unbind() if tensor.is_nested else (tensor,)
            for part in parts:
                if part.is_floating_point() and part.numel():
                    whole = unwrapped(part.detach())
                    self.maxima.append(_largest_finite(whole))
                    self.infinite.append(torch.isinf(whole).any())
                    self.called.append(self.leaves[module])

    def attach(self) -> list[torch.utils.hooks.RemovableHandle]:
        """A forward hook on every watched leaf, run eagerly, also where a compiled model is
        run eagerly: traced, the growing lists recompile every call (seen on an H100: the
        recompile limit hit in every pass)."""
        eagerly = torch.compiler.disable(self._watch)
        return [leaf.register_forward_hook(eagerly) for leaf in self.leaves]

    def inside(self) -> contextlib.AbstractContextManager[Any]:
        return _Fp16Watch(self.maxima) if self.fp16 else contextlib.nullcontext()

    def reading(self) -> ActivationRange:
        hits = torch.stack(self.infinite).tolist() if self.infinite else []
        return ActivationRange(
            largest=float(torch.stack(self.maxima).max()) if self.maxima else 0.0,
            infinite_leaves=tuple(
                sorted({name for name, hit in zip(self.called, hits, strict=True) if hit})
            ),
        )


class _Fp16Watch(TorchFunctionMode):
    """The largest finite |value| of every op's fp16 output, not only of leaf modules': attention
    logits (``q @ k.T``) computed inside a module with children overflow fp16 first, and no
    leaf hook sees them (found by a hunt). Ops that autocast runs in fp32, and modules kept in
    fp32, give fp32 outputs and are not read."""

    def __init__(self, maxima: list[torch.Tensor]) -> None:
        super().__init__()
        self.maxima = maxima

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, tuple | list) else (result,)
        for output in outputs:
            if (
                isinstance(output, torch.Tensor)
                and output.dtype == torch.float16
                and not output.is_nested
                and output.numel()
            ):
                self.maxima.append(_largest_finite(unwrapped(output.detach())))
        return result


class ActivationRange(NamedTuple):
    """What the held-out pass saw of the watched leaf modules' outputs."""

    largest: float
    """The largest finite |value| (0.0 when nothing was watched)."""
    infinite_leaves: tuple[str, ...]
    """The watched leaves whose output held an infinity (sorted): compared with fp32's, an
    fp16 overflow the largest finite value cannot show."""


MASK_FILL_SHARE = 0.995
"""Values at or below this share of the dtype's most negative value are mask fills: a mask of
``finfo.min`` added to fp16 scores rounds to about -65472 (a review), not exactly -65504. Kept
narrow (0.5%, 327 in fp16): under keep_fp32 only the trial's range is read, and 3% hid a real
activation at -64000 (a review)."""


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor: a module called under ``torch.vmap`` (an ensemble, a
    per-element network) or ``torch.func.grad`` returns functorch wrappers, and a value
    computed from one inside the transform and kept past it raised "maybe_level.has_value()
    INTERNAL ASSERT FAILED" when the held-out pass stacked it, losing the whole run (found by
    a hunt). Unwrapped, a vmapped output holds every element of its batch."""
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


def _largest_finite(tensor: torch.Tensor) -> torch.Tensor:
    """The largest finite |value| (on the device), mask fills left out: -inf in masked logits is
    there on purpose, in fp32 too, and no overflow; so is ``torch.finfo(dtype).min`` (and
    within 0.5% of it: ``MASK_FILL_SHARE``), the fill transformers' attention masks write
    (``masked_fill(mask, finfo(dtype).min)``, -65504 in fp16): read as an activation, it
    rejected amp_fp16 on a T5 for "activations reach 6.55e+04" (found by a hunt). +65504
    still counts: a clamp or ``nan_to_num`` that turns an overflow into it (a review). An
    fp16 overflow shows as inf, as fp32's large finite value, and as outputs or losses no
    longer finite."""
    read = torch.isfinite(tensor) & (tensor > MASK_FILL_SHARE * torch.finfo(tensor.dtype).min)
    # |values| in fp32: an fp16 ``abs()`` here is itself an fp16 op the watch reads, the fill
    # turned into +65504 (the leaf hooks run under it)
    return torch.where(read, tensor.float().abs(), 0).max()


def leg_steps(steps: int, points: Sequence[LrPoint]) -> list[int]:
    """Split ``steps`` over the legs: equal shares, the first leg takes the remainder."""
    if len(points) > steps:
        raise ValueError(f"{len(points)} lr legs need at least {len(points)} steps, got {steps}.")
    share = steps // len(points)
    return [steps - share * (len(points) - 1)] + [share] * (len(points) - 1)


def _set_lrs(optimizer: torch.optim.Optimizer, point: LrPoint) -> None:
    if len(point.lrs) != len(optimizer.param_groups):
        raise ValueError(
            f"The lr plan has {len(point.lrs)} group(s) but the trial's optimizer "
            f"{len(optimizer.param_groups)}: the optimizer factory must build the same groups "
            "every time."
        )
    for group, lr in zip(optimizer.param_groups, point.lrs, strict=True):
        group["lr"] = lr
    if point.momenta is not None:  # OneCycleLR, CyclicLR: the momentum the schedule sets there
        for group, momentum in zip(optimizer.param_groups, point.momenta, strict=True):
            set_group_momentum(group, momentum)


class TrainingLoop:
    """The training loop of one trial: optimizer steps of ``grad_accumulation_steps``
    micro-batches each, run exactly as ``apply()`` runs them (``plan.step``), timed in windows
    with no host read inside one."""

    def __init__(
        self,
        plan: PrecisionPlan,
        recipe: TrainingRecipe,
        batches: Sequence[Any],
        order: list[int],
        device: torch.device,
    ) -> None:
        self.plan, self.recipe, self.batches, self.order = plan, recipe, batches, order
        self.device, self.clock = device, WindowClock(device)
        self.figures: dict[str, Any] = {
            "losses": [], "windows": [], "rss": [], "max_gradient": 0.0,
        }  # fmt: skip
        self.micro = 0
        self.current_step: int | None = None
        self.passes: list[float] = []  # seconds of each pass before the timed windows (eager)
        self.kept = plan.mode.parameter_ids(plan.model, plan.mode.kept_roots(plan.model))
        self.counts_activations = device.type == "cpu" and not plan.spec.compile
        """Count the bytes saved for backward (CPU memory objective) on the first micro-batch;
        on a GPU the allocator's peak holds them already, and compiled graphs save inside
        the compiled function."""
        self._losses: list[torch.Tensor] = []  # this window's, on the device
        self._gradient: torch.Tensor | None = None  # at the window's last step, on the device
        self._samples, self._tokens = 0, 0
        self._batch_counts: dict[int, tuple[int, int | None]] = {}
        self.never_reached: dict[int, torch.nn.Parameter] = {
            id(p): p for p in plan.model.parameters() if p.requires_grad
        }
        """Trainable parameters no step has given a gradient yet (see ``_note_gradients``)."""

    def run_window(self, first_step: int, steps: int, warmup: bool) -> TrialFailure | None:
        """Steps ``first_step`` to ``first_step + steps - 1``, timed as one window; the
        window's failure (non-finite loss or gradient, at the step it first appeared) or None."""
        self._losses, self._gradient = [], None
        self._samples, self._tokens = 0, 0
        self.clock.start()
        last = first_step + steps - 1
        for step in range(first_step, first_step + steps):
            self.step(step, read_gradient=step == last)
        seconds = self.clock.stop()
        if self.device.type == "cpu":  # after the clock: reading /proc is not the mode's time
            self.figures["rss"].append(rss_bytes())
        if warmup:
            self.note_pass(seconds / steps)
        if warmup and self.plan.spec.compile:
            self.figures["graphs_after_warmup"] = compiled_graph_count()
        self.figures["windows"].append(
            StepWindow(
                first_step=first_step,
                steps=steps,
                seconds=seconds,
                samples=self._samples,
                tokens=self._tokens,
                warmup=warmup,
            )
        )
        return self._read_window(first_step)

    def step(self, step: int, read_gradient: bool = False) -> None:
        """One optimizer step. Nothing is read back to the host: the loss (and, with
        ``read_gradient``, the gradient maximum) stays on the device until the window's end.

        The gradient maximum is taken at a window's last step only: a pass over every gradient
        at every step is work the user's loop does not do: it made the trial 3-4% slower than
        that loop (``benchmarks.trial_timing``, TinyGPT on our CPU machines: trial/loop 0.963
        -> 0.990 in fp32, 0.929 -> 0.970 in amp_bf16). A non-finite gradient at another step
        still fails the trial, through the next step's loss."""
        self.current_step = step
        plan, accumulation = self.plan, self.recipe.grad_accumulation_steps
        summed: torch.Tensor | None = None  # a sum, not a list: 10**9 micro-batches grew 2.5 GB
        for micro in range(accumulation):
            index = self.order[self.micro % len(self.batches)]
            batch = to_device(self.batches[index], self.device)
            # before the forward: a train_step popping the batch's keys leaves none (a review)
            samples, counted = self._counts(index, batch)
            self.micro += 1
            if self.micro == 1 and self.counts_activations:  # a warm-up step: not timed
                loss = self._counted_forward(batch)
            else:
                with plan.autocast():
                    loss, _ = forward_and_loss(
                        plan, batch, self.recipe.loss_fn, self.recipe.train_step
                    )
            value = loss.detach().float().reshape(())
            summed = value if summed is None else summed + value
            self._samples += samples
            if counted is None or self._tokens is None:
                self._tokens = None
            else:
                self._tokens += counted
            if micro < accumulation - 1:
                plan.step(loss)  # backward; an accumulation micro-batch does not step
            else:
                plan.backward(loss)
        assert summed is not None  # accumulation >= 1
        self._losses.append(summed / accumulation)
        if read_gradient:
            self._gradient = max_abs_gradient(plan, self.kept)
        self._note_gradients()
        stepped = plan.step()
        self.figures["steps_done"] = step + 1
        if stepped and "state" not in self.figures:  # steady state: after a real step
            self.figures["state"] = state_bytes(plan)
            self.figures["moment"] = low_precision_moment(plan)
            self.figures["adam_beta2"] = nearest_adam_beta2(plan)
            self.figures["decay"] = nearest_rounded_decay(plan)  # at the first leg's (peak) lr

    def _counted_forward(self, batch: Any) -> torch.Tensor:
        """The loss of ``batch``, with the bytes its forward saves for backward counted
        (``figures["activation_bytes"]``). torch.func's gradient transforms (``grad``,
        ``jacrev``, ``hessian``: MAML, a physics residual by ``vmap(hessian(...))``) refuse
        saved-tensor hooks, and every run failed at step 0 (found by a hunt): such a forward
        runs again without them, from the same random streams and buffers, and this run's
        saved activations are not counted (None, as for a compiled run)."""
        plan, recipe = self.plan, self.recipe
        saved = SavedForBackward(plan.model, tensors_in(batch))
        drawn, slots = stream_states(self.device), buffer_slots(plan.model)
        values, empty = kept_values(slots), empty_buffer_slots(plan.model)
        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack),
                plan.autocast(),
            ):
                loss, _ = forward_and_loss(plan, batch, recipe.loss_fn, recipe.train_step)
        except RuntimeError as error:
            if _HOOKS_REFUSED not in str(error):
                raise
            self.counts_activations = False
            restore_buffer_slots(plan.model, slots, values, empty)
            set_streams(self.device, drawn)
            with plan.autocast():
                loss, _ = forward_and_loss(plan, batch, recipe.loss_fn, recipe.train_step)
            return loss
        self.figures["activation_bytes"] = saved.bytes
        return loss

    def _note_gradients(self) -> None:
        """Drop the parameters that got a gradient this step from ``never_reached``: after the
        first step only those no loss reaches are left (an EMA teacher left trainable), so a
        step reads the ``.grad`` of a few tensors, not of the model."""
        if self.never_reached:
            reached = [key for key, p in self.never_reached.items() if p.grad is not None]
            for key in reached:
                del self.never_reached[key]

    def _counts(self, index: int, batch: Any) -> tuple[int, int | None]:
        """Samples and tokens of held batch ``index`` (``batch``, as this step read it),
        counted once: a step reads no batch structure the user's loop does not. Counted from
        the batch read, not read again: a second read of a watched batch was the copy the
        calibration compares, and an in-place change of the batch went unseen (found by a
        review)."""
        if index not in self._batch_counts:
            self._batch_counts[index] = count_batch(batch)
        return self._batch_counts[index]

    def _read_window(self, first_step: int) -> TrialFailure | None:
        """The window's one host read: its losses and its last step's gradient maximum,
        checked for non-finite values (the loss scaler handles amp_fp16's inf/nan gradients)."""
        losses = torch.stack(self._losses)
        gradient = self._gradient
        gradient = torch.zeros_like(losses[:1]) if gradient is None else gradient.reshape(1)
        *losses_read, gradient_read = torch.cat([losses, gradient.to(losses)]).tolist()
        for offset, loss in enumerate(losses_read):
            step = first_step + offset
            self.figures["losses"].append(loss)
            if not math.isfinite(loss):
                return TrialFailure(
                    kind="non_finite_loss", step=step, message=f"loss is {loss} at step {step}"
                )
        last = first_step + len(losses_read) - 1
        if not math.isfinite(gradient_read) and self.plan.spec.mode != "amp_fp16":
            message = f"gradient is {gradient_read} at step {last}"
            return TrialFailure(kind="non_finite_gradient", step=last, message=message)
        if math.isfinite(gradient_read):
            self.figures["max_gradient"] = max(self.figures["max_gradient"], gradient_read)
        return None

    def note_pass(self, seconds: float) -> None:
        """A forward-and-backward pass before the timed windows took ``seconds``: the fastest
        is a floor on an eager run's step time (a compiled run's first passes compile)."""
        if not self.plan.spec.compile:
            self.passes.append(seconds)

    def progress(self, step: int, steps: int) -> TrialProgress:
        state = self.figures.get("state")
        return TrialProgress(
            step=step,
            steps_planned=steps,
            windows=tuple(self.figures["windows"]),
            state_bytes=None if state is None else state.total,
            pass_seconds=tuple(self.passes),
        )


def stop_reason(stop: StopCheck | None, progress: TrialProgress) -> str | None:
    """The stop check's reason to end the trial now, or None; what the check itself raises is
    the caller's failure, not the mode's (``StopCheckRaised``)."""
    if stop is None:
        return None
    try:
        return stop(progress)
    except Exception as error:  # the caller's callback: not the mode's failure
        raise StopCheckRaised(error) from error


class _SettleStopped(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


SETTLE_BATCHES = 8
"""The distinct batches a mode calibrates on before a trial (amp_fp16 halves its loss scale
until each one's gradients are finite), in the order the trial reads them. Settled on the
first alone, the scale backed off on the others during the trial, and a short trial counted
those as skips: 16 batches whose largest gradients ranged 88-547 rejected amp_fp16 in a
20-step check ("skipped 3 of 20"), and passed it settled on 4 or 8 (found by a hunt;
``tests/test_screening.py``); a 12-step check of them still reads short on movement (73%)
unless all 16 settle, and tune()'s trials run 20 steps or more. Each costs one forward and
backward pass at the settled scale, before any step is timed."""


def settle(
    loop: TrainingLoop,
    device: torch.device,
    stop: StopCheck | None = None,
    steps: int = 0,
    source: nn.Module | None = None,
) -> str | None:
    """Let the mode calibrate on the trial's first batches (amp_fp16 settles its loss scale) without
    stepping, without moving the model's random stream, and without leaving what its forward
    passes update: BatchNorm's running statistics, a running normaliser, a teacher a
    ``train_step`` moves (the user's loop runs no such forward; an amp_fp16 trial of a
    BatchNorm net started from statistics one batch on, its held-out loss 2% off).

    With ``stop`` (the trial's, of ``steps`` planned steps), the budget is checked before each
    of the mode's passes and after the last, each pass timed (``TrainingLoop.note_pass``; why:
    ``search._warmup_pace``). ``source``, the model the copy was made from (None when the copy
    was nudged from it), puts back a parameter the optimizer holds that a pass moved
    (``_put_back_moved``). Returns the stop's reason, or None."""
    plan, recipe = loop.plan, loop.recipe
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    numbers: list[_ModuleNumbers] = []
    started: list[float] = []  # when each pass began

    def check() -> None:
        if started:
            loop.note_pass(time.perf_counter() - started[-1])
        reason = stop_reason(stop, loop.progress(-1, steps))
        if reason is not None:
            raise _SettleStopped(reason)

    def compute_loss(index: int) -> torch.Tensor:  # called only by modes that calibrate
        check()
        started.append(time.perf_counter())
        if len(started) == 1:  # before the first pass
            state = state_no_optimizer_steps(plan.model, plan.optimizer)
            kept.extend((tensor, tensor.detach().clone()) for _, tensor in state)
            numbers.append(_ModuleNumbers(plan.model))
        batch = to_device(loop.batches[index], device)
        with plan.autocast():
            loss, _ = forward_and_loss(plan, batch, recipe.loss_fn, recipe.train_step)
        return loss / recipe.grad_accumulation_steps

    # the first SETTLE_BATCHES distinct batches the trial reads, each in turn: settled on the
    # first alone, a scale batches with 6x its gradients overflowed backed off 3 times in a
    # 20-step trial, counted as skips (found by a hunt)
    first = list(dict.fromkeys(loop.order))[:SETTLE_BATCHES]
    try:
        with kept_streams(cuda_devices_of(device)), optimizers_kept():
            for index in first:
                plan.mode.settle(lambda index=index: compute_loss(index), plan.model)
        scale = plan.mode.loss_scale_tensor()
        if scale is not None:  # before any step: what the scale-collapse check starts from
            loop.figures["settled_loss_scale"] = float(scale)
        if started:
            check()
    except _SettleStopped as stopped:
        return stopped.reason
    finally:
        with torch.no_grad():
            for tensor, before in kept:
                tensor.copy_(before)
            for kept_numbers in numbers:
                kept_numbers.put_back()
            if started and source is not None:
                _put_back_moved(plan.model, source)
    return None


_SMALL_TENSOR = 16
"""Elements of the largest plain tensor attribute :class:`_ModuleNumbers` keeps: a count or a
step held as a tensor, not a cache."""


def _counted(value: Any) -> bool:
    """An int, float (not a bool's ``training``: bool is an int, and it stays) or small tensor:
    what a module may count with."""
    if isinstance(value, torch.Tensor):
        return value.numel() <= _SMALL_TENSOR
    return isinstance(value, int | float)


class _ModuleNumbers:
    """The int and float attributes of a model's modules, and copies of their small plain
    tensor attributes (not parameters or buffers): a step count a ``train_step`` keeps on the
    model (a DQN copying its target network every 20 calls). The settle passes advanced it,
    and the amp_fp16 trial copied its target 8 steps before every other run did (found by a
    hunt; the tensor count, and one the passes create, a review). :meth:`put_back` puts them
    back and drops such attributes the passes added (``getattr(model, "calls", 0) + 1``)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = [(module, set(vars(module))) for module in model.modules()]
        self.values = [
            (
                module,
                key,
                (value, value.detach().clone()) if isinstance(value, torch.Tensor) else value,
            )
            for module in model.modules()
            for key, value in vars(module).items()
            if key != "training" and _counted(value)
        ]

    def put_back(self) -> None:
        for module, names in self.names:
            for added in [key for key in vars(module) if key not in names]:
                if _counted(vars(module)[added]):
                    delattr(module, added)
        for module, key, value in self.values:
            if isinstance(value, tuple):  # a tensor: changed in place (+=) or replaced
                tensor, before = value
                with torch.no_grad():
                    tensor.copy_(before)
                value = tensor
            if vars(module).get(key) is not value:
                setattr(module, key, value)


@contextlib.contextmanager
def optimizers_kept() -> Iterator[None]:
    """Run a block; an optimizer that steps in it (a ``train_step``'s own: a GAN's critic, a
    SAM's inner step) gets back the state it had before its first step there. amp_fp16's
    settle passes call the ``train_step``: its critic's weights were put back, its Adam's
    state was not, and the trial began at Adam step 18 with averages of passes no run makes,
    where every fp32 run began at step 0 (found by a hunt). So does an lr scheduler it steps
    (``LRScheduler.step`` and the subclasses' own, ReduceLROnPlateau's, SequentialLR's): a
    critic's StepLR decayed 9 calls early (a review). Nothing to copy when none steps;
    another thread's are left alone (the hooks are process-wide)."""
    before: dict[int, tuple[Any, dict[str, Any]]] = {}
    thread = threading.get_ident()

    def keep(stepped: Any) -> None:
        if threading.get_ident() == thread and id(stepped) not in before:
            before[id(stepped)] = (stepped, copy.deepcopy(stepped.state_dict()))

    def kept_step(step: Callable[..., Any]) -> Callable[..., Any]:
        def step_kept(scheduler: LRScheduler, *args: Any, **kwargs: Any) -> Any:
            if getattr(scheduler, "_step_count", 1):  # not the step its construction takes
                keep(scheduler)
            return step(scheduler, *args, **kwargs)

        return step_kept

    steps = {cls: vars(cls)["step"] for cls in _scheduler_classes() if "step" in vars(cls)}
    handle = register_optimizer_step_pre_hook(lambda optimizer, _args, _kwargs: keep(optimizer))
    for cls, step in steps.items():
        cls.step = kept_step(step)  # type: ignore[method-assign]
    try:
        yield
    finally:
        handle.remove()
        for cls, step in steps.items():
            cls.step = step  # type: ignore[method-assign]
        for stepped, state in before.values():  # optimizers first: a scheduler sets their lr
            if isinstance(stepped, torch.optim.Optimizer):
                stepped.load_state_dict(state)
        for stepped, state in before.values():
            if not isinstance(stepped, torch.optim.Optimizer):
                stepped.load_state_dict(state)


def _scheduler_classes(cls: type = LRScheduler) -> Iterator[type]:
    """``cls`` and every subclass of it loaded."""
    yield cls
    for subclass in cls.__subclasses__():
        yield from _scheduler_classes(subclass)


def _put_back_moved(model: nn.Module, source: nn.Module) -> None:
    """Parameters a settle pass moved get back the values of ``source``, the model the copy was
    made from: no optimizer step runs in one, so what moved is a ``train_step``'s in-place
    update of a parameter the optimizer holds (an EMA teacher left trainable; found by a
    review: amp_fp16's trial started 8 EMA updates ahead of the reference). One comparison
    of each weight with its source, for the modes that settle."""
    originals = dict(source.named_parameters())
    for name, parameter in model.named_parameters():
        original = originals.get(name)
        if original is None or original.shape != parameter.shape:
            continue
        original = original.to(parameter.device, parameter.dtype)
        if not torch.equal(parameter, original):
            parameter.copy_(original)


def measure_trained(
    loop: TrainingLoop,
    heldout: Sequence[Any],
    eval_fn: EvalFn | None,
) -> list[OutputSummary | None]:
    """Held-out losses, outputs and activation range, and ``eval_fn``, on the trained copy."""
    plan, figures, recipe = loop.plan, loop.figures, loop.recipe
    losses, outputs, activation = heldout_pass(
        plan, heldout, loop.device, recipe.loss_fn, recipe.train_step
    )
    figures["heldout"] = losses
    figures["activation"] = activation.largest if heldout else None
    figures["infinite_leaves"] = activation.infinite_leaves if heldout else None
    if eval_fn is not None:
        plan.model.eval()

        def score(grad: bool) -> float:  # with gradients where it needs them (a review)
            with torch.set_grad_enabled(grad), plan.autocast():
                return _eval_score(eval_fn, plan.model)

        figures["eval"] = with_gradients_if_needed(loop.device, score)
        plan.model.train()
    return outputs


def _eval_score(eval_fn: EvalFn, model: nn.Module) -> float:
    """``eval_fn(model)`` as one float; its own errors become :class:`EvalFnError` (a failed
    eval, not a failed training run). A non-finite score is returned as it is: the gate
    judges it."""
    try:
        with torch_settings_kept():
            score = eval_fn(model)
    except Exception as error:
        raise EvalFnError(
            f"eval_fn(model) raised {type(error).__name__}: {first_line(error)}"
        ) from error
    if (
        isinstance(score, torch.Tensor)
        and score.numel() == 1
        and not (score.dtype == torch.bool or score.is_complex())
    ):
        return float(score.detach().float().item())  # a bool or complex one stays refused
    if type(score).__module__ == "numpy" and getattr(score, "size", None) == 1:
        score = score.item()  # a 0-d or one-element array: its number (a bool stays refused)
    if isinstance(score, bool) or not isinstance(score, numbers.Real):
        shape = f" of shape {tuple(score.shape)}" if isinstance(score, torch.Tensor) else ""
        dtype = f" ({score.dtype})" if isinstance(score, torch.Tensor) else ""
        raise EvalFnError(
            f"eval_fn(model) returned {type(score).__name__}{shape}{dtype}, not one real number"
            " (lower is better): return a loss or an error rate, such as 1 - accuracy"
        )
    return float(score)


def train_in_windows(
    loop: TrainingLoop,
    result: TrialResult,
    points: Sequence[LrPoint],
    legs: list[int],
    warmup_steps: int,
    window_steps: int,
    stop: StopCheck | None,
) -> tuple[TrialFailure | None, str | None]:
    """Train every leg at its learning rates, in windows of steps (each warm-up step forms a
    window of its own, and so does the first step after them; no window crosses a leg);
    (failure, stop reason). ``loop.current_step`` is the last step run. The state outside
    the optimizer is digested after the first window too (``TrialResult.outside_state``)."""
    step, total = 0, sum(legs)
    for point, leg in zip(points, legs, strict=True):
        _set_lrs(loop.plan.optimizer, point)
        leg_end = step + leg
        while step < leg_end:
            warmup = step < warmup_steps
            # the first step after warm-up is a window of its own: the stop check's first step
            # time, so a mode far slower than fp32 is stopped for the budget after one step
            # rather than a whole window (a 3.5 s fp16 step on a CPU: 10 steps past a 30 s wall)
            length = 1 if step == warmup_steps else window_steps
            # each warm-up step too, so the budget is checked after each (search._warmup_pace)
            end = min(leg_end, step + 1 if warmup else step + length)
            failure = loop.run_window(step, end - step, warmup)
            raise_if_interrupted()  # a Ctrl-C the garbage collector swallowed in the window
            if step == 0 and failure is None:  # state the first step created, as it made it
                result.outside_state.append(outside_state(loop.plan.model, loop.plan.optimizer))
            step = end
            if failure is not None:
                return failure, None
            reason = stop_reason(stop, loop.progress(step - 1, total))
            if reason is not None:
                return None, reason
        result.leg_weights.append(sampled_weights(loop.plan, result.sample_indices))
    return None, None
