"""One short, measured training run of a mode on a deep copy of the user's model.

Every trial starts from the same weights (a deep copy; the user's model, its grads and the RNG
states are left exactly as they were), the same seed and the same batches as the fp32
reference. Failures (out of memory, an exception in the model, a non-finite loss, gradient or
weight) are recorded with the step and message, never raised; memory is freed afterwards.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec.batching import EvalFn
from autoprec.eligibility import Situation, model_device
from autoprec.interrupts import raise_if_interrupted
from autoprec.model_copies import carry_unsaved_state, deep_copy, floating_dtype, nudge_weights
from autoprec.outside_state import CarriedState
from autoprec.own_autocast import autocast_state_kept
from autoprec.plan import PrecisionPlan, build_plan
from autoprec.random_streams import drew_between, replayed_streams, seeded_streams, stream_states
from autoprec.recipe import LrPoint, TrainingRecipe
from autoprec.specs import ModeSpec
from autoprec.stochastic_optim import pin_rounding_seed
from autoprec.trial_failures import StopCheckRaised, failure_of, first_line, is_oom
from autoprec.trial_loop import (
    TrainingLoop,
    heldout_pass,
    ignores_row_constants,
    leg_steps,
    measure_trained,
    settle,
    train_in_windows,
    window_steps_for,
)
from autoprec.trial_measures import (
    MOVEMENT_SAMPLE_ELEMENTS,
    compile_counts,
    compiled_graph_count,
    memory_now,
    memory_peak,
    outside_state,
    parameter_group_indices,
    sample_indices,
    sampled_weights,
    state_bytes,
    torch_settings_kept,
    unstepped_parameter_digests,
)
from autoprec.trial_records import (
    OutputSummary,
    StopCheck,
    TrialFailure,
    TrialRecord,
    TrialResult,
    measured_windows,
)


@dataclass(frozen=True)
class _TrialInputs:
    """What one trial trains and how (``run_trial``'s arguments, resolved)."""

    spec: ModeSpec
    model: nn.Module
    batches: Sequence[Any]
    order: list[int]
    recipe: TrainingRecipe
    device: torch.device
    situation: Situation | None
    points: tuple[LrPoint, ...] | None
    """The legs' learning rates; None: the optimizer's own (one constant leg)."""
    legs: list[int]
    warmup_steps: int
    window_steps: int
    heldout: Sequence[Any]
    eval_fn: EvalFn | None
    stop: StopCheck | None
    nudge_seed: int | None = None
    """Nudge the copy's weights by 2^-12 from this seed (``nudge_weights``)."""
    carried: CarriedState | None = None
    """The counters and carried state the ``train_step`` keeps outside the model, as the
    caller found them (None: found here, once training is done)."""


@dataclass
class _CopyRun:
    """How training the copy went: the loop's figures, the mode (its loss-scaler figures), the
    legs' learning rates and how it ended."""

    figures: dict[str, Any] = field(default_factory=dict)
    mode: Any = None
    points: tuple[LrPoint, ...] = ()
    fp8_layers: tuple[str, ...] = ()
    failure: TrialFailure | None = None
    stopped: str | None = None
    draws_random: bool = False


def _batch_order(count: int, shuffle_seed: int | None) -> list[int]:
    """The batches in order, or in a seeded random order (the noise reference)."""
    if shuffle_seed is None:
        return list(range(count))
    order = torch.randperm(count, generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    if order == list(range(count)):
        # a random order can be the loader's own (1 in 2 for two batches): the noise run then
        # repeated the reference, and the loss floor fell to its minimum (found by a hunt)
        order = order[1:] + order[:1]
    return order


def _constant_point(plan: PrecisionPlan) -> LrPoint:
    """One leg at the optimizer's own learning rates."""
    lrs = tuple(float(group["lr"]) for group in plan.optimizer.param_groups)
    return LrPoint(role="constant", lrs=lrs)


def _plan_for(inputs: _TrialInputs) -> PrecisionPlan:
    """A deep copy of the model in train mode, in the trial's mode, with the recipe's optimizer.
    ``train()`` is called as training loops, HF's Trainer and Lightning call it (each step or
    epoch): a submodule set to eval once beforehand trains in train mode there too, and a
    model whose own ``train()`` keeps a BatchNorm frozen keeps it frozen here."""
    trained = deep_copy(inputs.model).train()
    if inputs.nudge_seed is not None:
        nudge_weights(trained, inputs.nudge_seed)
    recipe = inputs.recipe
    plan = build_plan(
        inputs.spec,
        trained,
        recipe.make_optimizer(inputs.model, trained, with_state=True),
        grad_accumulation_steps=recipe.grad_accumulation_steps,
        clip_grad_norm=recipe.clip_grad_norm,
        situation=inputs.situation,
    )
    # the run's seed rounds, in a process group too (where a user's run seeds from the
    # weights, alike in every trial: seeds 0 and 5 rounded alike; found by a review)
    pin_rounding_seed(plan.optimizer, torch.initial_seed())
    return plan


def _fp32_reader(
    inputs: _TrialInputs, plan: PrecisionPlan, figures: dict[str, Any]
) -> PrecisionPlan | None:
    """A plain fp32 model (a fresh copy of the user's, no autocast) holding the trained copy's
    own weights, buffers and plain attributes, to read the held-out batches beside the mode's
    own held-out losses: what the mode's forward pass alone costs, with no seed noise in it.
    Built before the mode's held-out pass, which calls your ``train_step`` or forward again
    and may move a buffer (a running baseline, a target's mean): built after it, the two reads
    started from different state, and amp_bf16 read "+40.9%" with a running mean moved in
    eval mode (found by a hunt). Counters and carried state a ``train_step`` keeps outside the
    model (:class:`CarriedState`) are put back between the two reads, in fp32; a tensor it
    changes in place (a closure's baseline) still moves between them (a review). None for
    fp32, where the mode's weights do not map back onto
    the user's model (a module swap that renames parameters), and where building it raised or
    did not fit in memory (why, in ``figures``): the trial itself is not failed for it."""
    if inputs.spec.mode == "fp32" or not inputs.heldout:
        return None
    try:
        reader = deep_copy(inputs.model)
        try:
            missing, _unexpected = reader.load_state_dict(plan.model.state_dict(), strict=False)
        except RuntimeError:  # a mode that changed a parameter's shape (packed weights)
            return None
        if missing:
            return None
        carry_unsaved_state(plan.model, reader)
        return build_plan(
            ModeSpec(mode="fp32"),
            reader,
            torch.optim.SGD(reader.parameters(), lr=0.0),  # never stepped: the plan needs one
            situation=inputs.situation,
        )
    except Exception as error:  # noqa: BLE001 - said in the verdict's notes, not the mode's
        figures["fp32_read_failure"] = _read_failure(error)
        return None


def _class_like(outputs: list[OutputSummary | None]) -> bool:
    """Does the first held-out output have a class dimension (more than one value a row)?"""
    return bool(outputs) and outputs[0] is not None and outputs[0].top1 is not None


def _row_constants(inputs: _TrialInputs, plan: PrecisionPlan) -> bool | None:
    """:func:`ignores_row_constants` on the first held-out batch; None where it raised (the
    gate's own reading: the output check then compares outputs as they are)."""
    recipe = inputs.recipe
    try:
        return ignores_row_constants(
            plan, inputs.heldout[0], inputs.device, recipe.loss_fn, recipe.train_step
        )
    except Exception:  # noqa: BLE001 - a reading of the gate's, not the run's failure
        return None


def _carried_now(inputs: _TrialInputs) -> CarriedState:
    """The ``train_step``'s carried state as training left it."""
    if inputs.carried is not None:
        return inputs.carried.now()
    return CarriedState(inputs.recipe.train_step)


def _read_failure(error: Exception) -> str:
    """Why the fp32 read of a trial's trained weights did not run: the trial itself is not
    failed for it (a truncated-BPTT LSTM's state, carried in bf16 into the reader, failed
    every bf16 mode "at step 199"; found by a hunt), and the verdict says the forward cost
    was not measured, and why."""
    if is_oom(error):
        return "the fp32 copy did not fit in memory"
    return f"reading the trained weights in fp32 raised {type(error).__name__}: {first_line(error)}"


def _heldout_read_in_fp32(
    inputs: _TrialInputs, reader: PrecisionPlan | None, figures: dict[str, Any]
) -> list[float] | None:
    """The held-out losses of ``reader`` (:func:`_fp32_reader`), None without one or when the
    pass raised (its reason in the figures)."""
    if reader is None:
        return None
    try:
        recipe = inputs.recipe
        losses, _, _ = heldout_pass(
            reader, inputs.heldout, inputs.device, recipe.loss_fn, recipe.train_step
        )
    except Exception as error:  # noqa: BLE001 - said in the verdict's notes, not the mode's
        figures["fp32_read_failure"] = _read_failure(error)
        return None
    return losses


def _train_legs(
    loop: TrainingLoop,
    inputs: _TrialInputs,
    run: _CopyRun,
    result: TrialResult,
    baseline: dict[str, int],
) -> None:
    """Train every leg, sampling the weights before and after each; note whether training drew
    random numbers, its peak memory and a weight left non-finite."""
    plan, device = loop.plan, inputs.device
    result.sample_indices = sample_indices(plan.model, MOVEMENT_SAMPLE_ELEMENTS)
    result.parameter_groups = parameter_group_indices(plan)
    result.leg_weights.append(sampled_weights(plan, result.sample_indices))
    result.outside_state.append(outside_state(plan.model, plan.optimizer))
    before = stream_states(device)
    run.failure, run.stopped = train_in_windows(
        loop, result, run.points, inputs.legs, inputs.warmup_steps, inputs.window_steps, inputs.stop
    )
    result.outside_state.append(outside_state(plan.model, plan.optimizer))
    if len(result.leg_weights) > 1:  # a step ran: parameters no step reached are known
        first, last = result.leg_weights[0], result.leg_weights[-1]
        starts, ends = unstepped_parameter_digests(plan, loop.never_reached, first, last)
        result.outside_state[0].update(starts)
        result.outside_state[-1].update(ends)
    if inputs.spec.compile:  # the held-out pass (eval mode, no grad) compiles graphs of its own
        loop.figures["graphs_after_training"] = compiled_graph_count()
    run.draws_random = drew_between(before, stream_states(device))
    # the peak before the held-out pass and eval_fn, which are not the mode's
    loop.figures["peak"] = memory_peak(device, baseline, loop.figures["rss"])
    if run.failure is None and not all(
        bool(torch.isfinite(p).all()) for p in plan.model.parameters()
    ):
        step = loop.current_step
        message = f"weights are not finite after step {step}"
        run.failure = TrialFailure(kind="non_finite_weight", step=step, message=message)


def _measure_trained_copy(loop: TrainingLoop, inputs: _TrialInputs, result: TrialResult) -> None:
    """After training: the held-out pass and ``eval_fn``, the fp32 read of the trained
    weights (from the state the mode's pass started from: model, carried state, random
    draws), and for fp32 whether the loss ignores a constant per row."""
    started, plan = time.perf_counter(), loop.plan
    reader = _fp32_reader(inputs, plan, loop.figures)  # the trained state, before the pass
    drawn = stream_states(inputs.device)  # a loss that draws noise draws it alike twice
    carried = _carried_now(inputs) if reader is not None else None
    result.heldout_outputs = measure_trained(loop, inputs.heldout, inputs.eval_fn)
    if inputs.spec.mode == "fp32" and _class_like(result.heldout_outputs):
        loop.figures["row_constants"] = _row_constants(inputs, plan)
    if carried is not None and reader is not None:  # in the reader's dtype
        carried.restore(widened_to=floating_dtype(reader.model))
    with replayed_streams(inputs.device, drawn):
        loop.figures["heldout_fp32_read"] = _heldout_read_in_fp32(inputs, reader, loop.figures)
    del reader
    result.tail_seconds = time.perf_counter() - started


def _train_copy(inputs: _TrialInputs, result: TrialResult, baseline: dict[str, int]) -> _CopyRun:
    """Train and measure a deep copy of the model; a failure is recorded in the run, never
    raised, and the copy's memory is freed."""
    run = _CopyRun()
    plan: PrecisionPlan | None = None
    loop: TrainingLoop | None = None
    try:
        if inputs.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(inputs.device)
        plan = _plan_for(inputs)
        run.mode = plan.mode
        run.points = inputs.points or (_constant_point(plan),)
        run.fp8_layers = plan.mode.fp8_modules(plan.model)
        loop = TrainingLoop(plan, inputs.recipe, inputs.batches, inputs.order, inputs.device)
        run.figures = loop.figures
        source = inputs.model if inputs.nudge_seed is None else None
        run.stopped = settle(loop, inputs.device, inputs.stop, sum(inputs.legs), source)
        if run.stopped is None:
            _train_legs(loop, inputs, run, result, baseline)
        if run.failure is None and run.stopped is None:
            _measure_trained_copy(loop, inputs, result)
        if "state" not in loop.figures:  # no step stepped: measure what there is
            loop.figures["state"] = state_bytes(plan)
    except StopCheckRaised as raised:  # the caller's own callback failed: it stops the run
        raise raised.error from None
    except Exception as error:  # noqa: BLE001 - a failing trial is data, not a crash
        step = loop.current_step if loop is not None else None
        run.failure = failure_of(error, step, plan.model if plan is not None else None)
    finally:
        del plan, loop
        gc.collect()
        if inputs.device.type == "cuda":
            torch.cuda.empty_cache()
    return run


def run_trial(
    spec: ModeSpec,
    model: nn.Module,
    batches: Sequence[Any],
    *,
    recipe: TrainingRecipe,
    steps: int | None = None,
    lr_points: Sequence[LrPoint] | None = None,
    heldout: Sequence[Any] = (),
    eval_fn: EvalFn | None = None,
    warmup_steps: int = 2,
    window_steps: int | None = None,
    seed: int = 0,
    shuffle_seed: int | None = None,
    situation: Situation | None = None,
    stop: StopCheck | None = None,
    nudge_seed: int | None = None,
    carried: CarriedState | None = None,
) -> TrialResult:
    """Train a deep copy of ``model`` in ``spec`` for ``steps`` optimizer steps and measure it.

    The copy trains in train mode with the recipe's optimizer, accumulation and clipping, one
    leg per lr point (``recipe.lr_points``: the peak, then the schedule's floor), the steps
    split evenly between them.

    Args:
        batches: the training batches, cycled when the trial needs more.
        recipe: the user's training recipe.
        steps: optimizer steps (default: one per batch).
        lr_points: the learning rates of the legs (default: the optimizer's own lrs).
        heldout: batches never trained on: loss, outputs and activation range are measured on
            them after training.
        eval_fn: ``eval_fn(model) -> float`` called on the trained copy (lower is better).
        warmup_steps: first steps left out of speed figures (compilation, allocator growth);
            each is timed as a window of its own (the budget is checked after every one).
        window_steps: steps per timed window (default: :func:`window_steps_for`). Speed
            figures are medians over windows; nothing is read back to the host inside one.
        shuffle_seed: train on the batches in a seeded random order (the noise reference).
        stop: called after every step; a returned reason ends the trial early (not judged)
            What it raises propagates as it is (the caller's code, not the mode's failure).
        nudge_seed: nudge the copy's initial weights by 2^-12 (the paired run of a
            model without random draws: how far chaos alone takes a second fp32 run).
        carried: the ``train_step``'s counters and carried state outside the model
            (:class:`CarriedState`, the caller's watch's); put back as training left them,
            in fp32, between the mode's held-out pass and the fp32 read of its weights.
    """
    if not batches:
        raise ValueError("batches is empty: a trial needs at least one batch.")
    steps = len(batches) if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1 but got {steps}.")
    points = tuple(lr_points) if lr_points else None
    inputs = _TrialInputs(
        spec=spec,
        model=model,
        batches=batches,
        order=_batch_order(len(batches), shuffle_seed),
        recipe=recipe,
        device=torch.device(model_device(model)),
        situation=situation,
        points=points,
        legs=leg_steps(steps, points) if points else [steps],
        warmup_steps=warmup_steps,
        window_steps=window_steps or window_steps_for(steps, warmup_steps),
        heldout=heldout,
        eval_fn=eval_fn,
        stop=stop,
        nudge_seed=nudge_seed,
        carried=carried,
    )
    device = inputs.device
    started = time.perf_counter()
    result = TrialResult(
        record=TrialRecord(
            spec=spec, seed=seed, steps_planned=steps, steps_run=0, warmup_steps=warmup_steps
        )
    )
    graphs_before = 0
    if spec.compile:
        torch.compiler.reset()  # compile from scratch, as a fresh training process does
        graphs_before = compiled_graph_count()
    # what is not this trial, subtracted from its peak: taken after the reset and a collection,
    # which free what an earlier compiled trial's graphs held and an earlier trial's garbage
    # (reference cycles through hooks and modes). Freed mid-trial instead, it was subtracted
    # too: an H200 printed 227 MiB for amp_bf16's compiled 59M-parameter GPT and 309 MiB for
    # eager FP8 after fp32's trial, under their 900 MiB of weights and Adam state.
    gc.collect()
    raise_if_interrupted()  # one the collector swallowed (its weakref callbacks: a hunt)
    baseline = memory_now(device)
    with seeded_streams(device, seed), autocast_state_kept(), torch_settings_kept():
        run = _train_copy(inputs, result, baseline)
    raise_if_interrupted()  # the run's last collection may have swallowed one too
    if "peak" not in run.figures:  # failed or stopped before the end: the peak so far
        run.figures["peak"] = memory_peak(device, baseline, run.figures.get("rss", []))
    result.record = _record(inputs, seed, steps, run, graphs_before, time.perf_counter() - started)
    return result


def _steps_run(failure: TrialFailure | None, steps_done: int) -> int:
    """Steps that ran cleanly: a non-finite loss or gradient is found when its window is read,
    after the rest of the window ran on; the steps from the failing one on do not count."""
    if failure is not None and failure.kind in ("non_finite_loss", "non_finite_gradient"):
        return min(steps_done, failure.step or 0)
    return steps_done


def _median_rate(counts: list[tuple[int, float]]) -> float | None:
    """The median over the measured windows of (count / seconds), as the README says: one
    stalled window on a busy machine does not drag the figure (the total over the total did:
    fp32 recorded 305 samples/s against a median of 680 in one busy run; found by a hunt)."""
    if not counts:
        return None
    return statistics.median(count / seconds for count, seconds in counts)


def _record(
    inputs: _TrialInputs,
    seed: int,
    steps: int,
    run: _CopyRun,
    graphs_before: int,
    wall: float,
) -> TrialRecord:
    figures, mode, spec = run.figures, run.mode, inputs.spec
    windows = tuple(figures.get("windows", ()))
    measured = [window for window in measured_windows(windows) if window.seconds > 0]
    peak = figures.get("peak") or {}
    graphs, recompiles = compile_counts(figures, graphs_before)
    return TrialRecord(
        spec=spec,
        seed=seed,
        steps_planned=steps,
        steps_run=_steps_run(run.failure, figures.get("steps_done", 0)),
        warmup_steps=inputs.warmup_steps,
        failure=run.failure,
        losses=tuple(figures.get("losses", [])),
        samples_per_second=_median_rate([(w.samples, w.seconds) for w in measured]),
        tokens_per_second=(
            _median_rate([(w.tokens, w.seconds) for w in measured if w.tokens is not None])
            if all(window.tokens is not None for window in measured)
            else None
        ),
        median_step_seconds=(
            statistics.median(window.step_seconds for window in measured) if measured else None
        ),
        windows=windows,
        wall_seconds=wall,
        peak_memory_bytes=peak.get("allocated"),
        peak_reserved_bytes=peak.get("reserved"),
        peak_memory_source=peak.get("source"),
        state_bytes=figures.get("state"),
        activation_bytes=figures.get("activation_bytes"),
        max_abs_activation=figures.get("activation"),
        infinite_activation_leaves=figures.get("infinite_leaves"),
        max_abs_gradient=figures.get("max_gradient"),
        skipped_steps=0 if mode is None else mode.skipped_steps,
        final_loss_scale=mode.loss_scale if hasattr(mode, "loss_scale") and mode.scaler else None,
        settled_loss_scale=figures.get("settled_loss_scale"),
        heldout_losses=tuple(figures.get("heldout", ())),
        heldout_losses_fp32_read=tuple(figures.get("heldout_fp32_read") or ()),
        fp32_read_failure=figures.get("fp32_read_failure"),
        row_constants_ignored=figures.get("row_constants"),
        low_precision_moment=figures.get("moment"),
        nearest_adam_beta2=figures.get("adam_beta2"),
        nearest_rounded_decay=figures.get("decay"),
        eval_score=figures.get("eval"),
        speed_is_meaningful=not spec.emulate,
        stopped=run.stopped,
        lr_points=run.points,
        leg_steps=tuple(inputs.legs),
        draws_random=run.draws_random,
        fp8_layers=run.fp8_layers,
        compiled_graphs=graphs,
        recompiles=recompiles,
    )
