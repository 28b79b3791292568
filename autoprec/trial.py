"""One short, measured training run of a mode on a deep copy of the user's model.

Every trial starts from the same weights (a deep copy; the user's model, its grads and the RNG
states are left exactly as they were), the same seed and the same batches as the fp32
reference. Failures (out of memory, an exception in the model, a non-finite loss, gradient or
weight) are recorded with the step and message, never raised; memory is freed afterwards.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from autoprec.batching import (
    LossFn,
    TrainStep,
    count_samples,
    count_tokens,
    forward_and_loss,
    prediction,
    to_device,
)
from autoprec.eligibility import Situation, model_device
from autoprec.errors import UnsupportedModeError
from autoprec.optim import named_groups, rebuild_optimizer
from autoprec.plan import PrecisionPlan, prepare
from autoprec.specs import ModeSpec

OptimizerSource = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer]
"""An optimizer over the user's model (cloned per trial) or a factory ``params -> optimizer``."""

FailureKind = Literal[
    "unsupported", "exception", "out_of_memory",
    "non_finite_loss", "non_finite_gradient", "non_finite_weight",
]  # fmt: skip

MOVEMENT_SAMPLE_ELEMENTS = 2**20
"""Weight elements sampled (evenly across tensors) to measure how far training moved them."""

_COMPENSATION_KEYS = ("kahan_comp", "compensation")  # torch-optimi, StochasticAdamW


@dataclass(frozen=True)
class TrialProgress:
    """What a stop check sees after each step."""

    step: int
    steps_planned: int
    step_seconds: tuple[float, ...]
    warmup_steps: int
    state_bytes: int | None
    """Exact parameter + gradient + optimizer-state bytes, known after the first step."""


StopCheck = Callable[[TrialProgress], "str | None"]
"""Returns a reason to stop the trial early (budget, cannot win), or None to go on."""


class TrialFailure(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: FailureKind
    step: int | None
    message: str


class StateBytes(BaseModel):
    """Exact bytes of parameters, gradients and optimizer state (Kahan buffers, 8-bit states)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


class TrialRecord(BaseModel):
    """The figures of one trial: what crosses into the drift gate, the study and the profile."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: ModeSpec
    seed: int
    steps_planned: int
    steps_run: int
    warmup_steps: int
    failure: TrialFailure | None = None
    stopped: str | None = None
    """Why a stop check ended the trial early (it is then not judged), or None."""
    losses: tuple[float, ...] = ()
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    median_step_seconds: float | None = None
    wall_seconds: float = 0.0
    peak_memory_bytes: int | None = None
    peak_memory_source: Literal["cuda_allocator", "process_rss"] | None = None
    state_bytes: StateBytes | None = None
    max_abs_activation: float | None = None
    """Largest |output| of any leaf module over the held-out batches (fp16 overflow risk)."""
    max_abs_gradient: float | None = None
    """Largest |gradient| over the trial, loss scaling removed."""
    skipped_steps: int = 0
    final_loss_scale: float | None = None
    heldout_losses: tuple[float, ...] = ()
    eval_score: float | None = None
    speed_is_meaningful: bool = True
    """False for emulated FP8: its numerics are real, its speed is not."""

    @property
    def completed(self) -> bool:
        """Ran every planned step without failing."""
        return self.failure is None and self.stopped is None


TIMING_FIELDS = (
    "samples_per_second", "tokens_per_second", "median_step_seconds", "wall_seconds",
    "peak_memory_bytes",
)  # fmt: skip
"""Fields that differ between otherwise identical trials."""


@dataclass
class TrialResult:
    """A record plus what the drift gate compares: sampled weights and held-out outputs."""

    record: TrialRecord
    initial_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    final_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    sample_indices: dict[str, torch.Tensor] = field(default_factory=dict)
    heldout_outputs: list[torch.Tensor | None] = field(default_factory=list)


def _fresh_optimizer(source: OptimizerSource, user_model: nn.Module, copy_: nn.Module) -> Any:
    if isinstance(source, torch.optim.Optimizer):
        groups = named_groups(source, user_model)
        return rebuild_optimizer(source, groups, copy_, "same", require_fresh=False)
    if callable(source):
        return source(copy_.parameters())
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer or a factory params -> optimizer, "
        f"not {type(source).__name__}."
    )


def _sample_indices(model: nn.Module, budget: int) -> dict[str, torch.Tensor]:
    parameters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for _, p in parameters) or 1
    generator = torch.Generator().manual_seed(0)
    indices = {}
    for name, parameter in parameters:
        count = (
            parameter.numel() if total <= budget else max(1, parameter.numel() * budget // total)
        )
        chosen = torch.randperm(parameter.numel(), generator=generator)[:count]
        indices[name] = chosen.sort().values
    return indices


def _sampled(plan: PrecisionPlan, indices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sampled weight values in fp32, Kahan compensation included (it is part of the weight)."""
    parameters = dict(plan.model.named_parameters())
    values = {}
    for name, chosen in indices.items():
        parameter = parameters[name]
        weight = parameter.detach().float().flatten()
        state = plan.optimizer.state.get(parameter, {})
        for key in _COMPENSATION_KEYS:
            compensation = state.get(key)
            if isinstance(compensation, torch.Tensor) and compensation.shape == parameter.shape:
                weight = weight + compensation.detach().float().flatten()
        values[name] = weight[chosen.to(weight.device)].cpu()
    return values


def _state_bytes(plan: PrecisionPlan) -> StateBytes:
    parameters = [p for p in plan.model.parameters()]
    seen: set[tuple[int, str]] = set()
    optimizer = 0
    for state in plan.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                key = (value.data_ptr(), str(value.device))
                if key not in seen:
                    seen.add(key)
                    optimizer += value.numel() * value.element_size()
    return StateBytes(
        parameters=sum(p.numel() * p.element_size() for p in parameters),
        gradients=sum(p.numel() * p.element_size() for p in parameters if p.requires_grad),
        optimizer=optimizer,
    )


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _max_abs_gradient(plan: PrecisionPlan) -> float:
    grads = [p.grad for p in plan.model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    largest = float(torch.stack(torch._foreach_norm(grads, math.inf)).max())  # one sync
    scale = getattr(plan.mode, "loss_scale", None)
    return largest / scale if scale else largest


def _is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _heldout_pass(
    plan: PrecisionPlan,
    heldout: Sequence[Any],
    device: torch.device,
    loss_fn: LossFn | None,
    train_step: TrainStep | None,
) -> tuple[list[float], list[torch.Tensor | None], float]:
    maxima: list[torch.Tensor] = []  # reduced once at the end: no device sync per layer

    def watch(_module: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel():
            maxima.append(output.detach().abs().max().float())

    leaves = [m for m in plan.model.modules() if next(m.children(), None) is None]
    handles = [leaf.register_forward_hook(watch) for leaf in leaves]
    was_training = plan.model.training
    plan.model.eval()
    losses, outputs = [], []
    try:
        with torch.no_grad(), plan.autocast():
            for batch in heldout:
                loss, output = forward_and_loss(plan, to_device(batch, device), loss_fn, train_step)
                losses.append(float(loss.detach().float()))
                predicted = prediction(output)
                outputs.append(None if predicted is None else predicted.detach().float().cpu())
    finally:
        plan.model.train(was_training)
        for handle in handles:
            handle.remove()
    largest = float(torch.stack(maxima).max()) if maxima else 0.0
    return losses, outputs, largest


def run_trial(
    spec: ModeSpec,
    model: nn.Module,
    batches: Sequence[Any],
    *,
    optimizer: OptimizerSource,
    steps: int | None = None,
    loss_fn: LossFn | None = None,
    train_step: TrainStep | None = None,
    heldout: Sequence[Any] = (),
    eval_fn: Callable[[nn.Module], float] | None = None,
    warmup_steps: int = 2,
    seed: int = 0,
    shuffle_seed: int | None = None,
    situation: Situation | None = None,
    stop: StopCheck | None = None,
) -> TrialResult:
    """Train a deep copy of ``model`` in ``spec`` for ``steps`` steps and measure it.

    Args:
        batches: the training batches, cycled when ``steps`` exceeds their number.
        optimizer: the user's optimizer (cloned with its groups and hyper-parameters onto the
            copy) or a factory ``params -> optimizer``.
        heldout: batches never trained on: loss, outputs and activation range are measured on
            them after training.
        eval_fn: ``eval_fn(model) -> float`` called on the trained copy (lower is better).
        warmup_steps: first steps left out of speed figures (compilation, allocator growth).
        shuffle_seed: train on the batches in a seeded random order (the noise reference).
        stop: called after every step; a returned reason ends the trial early (not judged).
    """
    if not batches:
        raise ValueError("batches is empty: a trial needs at least one batch.")
    steps = len(batches) if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1 but got {steps}.")
    device = torch.device(model_device(model))
    order = list(range(len(batches)))
    if shuffle_seed is not None:
        order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(shuffle_seed))
        order = order.tolist()
    clock, started = _Clock(device), time.perf_counter()
    figures: dict[str, Any] = {"losses": [], "times": [], "samples": [], "tokens": [], "rss": []}
    result = TrialResult(
        record=TrialRecord(
            spec=spec, seed=seed, steps_planned=steps, steps_run=0, warmup_steps=warmup_steps
        )
    )
    step: int | None = None
    failure: TrialFailure | None = None
    stopped: str | None = None
    plan: PrecisionPlan | None = None
    cuda_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        try:
            trained = copy.deepcopy(model)
            plan = prepare(
                spec, trained, _fresh_optimizer(optimizer, model, trained), situation=situation
            )
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            result.sample_indices = _sample_indices(plan.model, MOVEMENT_SAMPLE_ELEMENTS)
            result.initial_weights = _sampled(plan, result.sample_indices)
            max_gradient = 0.0
            for step in range(steps):
                batch = to_device(batches[order[step % len(batches)]], device)
                start = clock.now()
                with plan.autocast():
                    loss, _ = forward_and_loss(plan, batch, loss_fn, train_step)
                loss_value = float(loss.detach().float())
                figures["losses"].append(loss_value)
                if not math.isfinite(loss_value):
                    failure = TrialFailure(
                        kind="non_finite_loss",
                        step=step,
                        message=f"loss is {loss_value} at step {step}",
                    )
                    break
                plan.backward(loss)
                gradient = _max_abs_gradient(plan)
                scaled = spec.mode == "amp_fp16"  # the loss scaler handles inf/nan gradients
                if not math.isfinite(gradient) and not scaled:
                    failure = TrialFailure(
                        kind="non_finite_gradient",
                        step=step,
                        message=f"gradient is {gradient} at step {step}",
                    )
                    break
                if math.isfinite(gradient):
                    max_gradient = max(max_gradient, gradient)
                plan.step()
                figures["times"].append(clock.now() - start)
                figures["samples"].append(count_samples(batch))
                figures["tokens"].append(count_tokens(batch))
                figures["rss"].append(_rss_bytes())
                if step == 0:
                    figures["state"] = _state_bytes(plan)
                if stop is not None:
                    progress = TrialProgress(
                        step=step,
                        steps_planned=steps,
                        step_seconds=tuple(figures["times"]),
                        warmup_steps=warmup_steps,
                        state_bytes=figures["state"].total,
                    )
                    stopped = stop(progress)
                    if stopped is not None:
                        break
            if failure is None and not all(
                bool(torch.isfinite(p).all()) for p in plan.model.parameters()
            ):
                failure = TrialFailure(
                    kind="non_finite_weight",
                    step=step,
                    message=f"weights are not finite after step {step}",
                )
            figures["max_gradient"] = max_gradient
            if failure is None and stopped is None:
                result.final_weights = _sampled(plan, result.sample_indices)
                losses, outputs, activation = _heldout_pass(
                    plan, heldout, device, loss_fn, train_step
                )
                figures["heldout"], result.heldout_outputs = losses, outputs
                figures["activation"] = activation if heldout else None
                if eval_fn is not None:
                    plan.model.eval()
                    with torch.no_grad(), plan.autocast():
                        figures["eval"] = float(eval_fn(plan.model))
                    plan.model.train()
            if "state" not in figures:  # measured after step 0 unless the trial ended before
                figures["state"] = _state_bytes(plan)
        except UnsupportedModeError as error:
            failure = TrialFailure(
                kind="unsupported", step=None, message="; ".join(error.reasons) or str(error)
            )
        except Exception as error:  # noqa: BLE001 - a failing trial is data, not a crash
            kind: FailureKind = "out_of_memory" if _is_oom(error) else "exception"
            first_line = (str(error).strip().splitlines() or [""])[0]
            failure = TrialFailure(
                kind=kind, step=step, message=f"{type(error).__name__}: {first_line}"
            )
        finally:
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            mode = plan.mode if plan is not None else None
            del plan
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    record = _record(
        spec, seed, steps, warmup_steps, failure, figures, peak, mode, time.perf_counter() - started
    )
    result.record = record.model_copy(update={"stopped": stopped})
    return result


def _record(
    spec: ModeSpec,
    seed: int,
    steps: int,
    warmup: int,
    failure: TrialFailure | None,
    figures: dict[str, Any],
    cuda_peak: int | None,
    mode: Any,
    wall: float,
) -> TrialRecord:
    times = figures["times"][warmup:]
    measured = sum(times)
    samples = sum(figures["samples"][warmup:])
    tokens = figures["tokens"][warmup:]
    rss = [value for value in figures["rss"] if value is not None]
    return TrialRecord(
        spec=spec,
        seed=seed,
        steps_planned=steps,
        steps_run=len(figures["times"]),
        warmup_steps=warmup,
        failure=failure,
        losses=tuple(figures["losses"]),
        samples_per_second=samples / measured if times and measured > 0 else None,
        tokens_per_second=(
            sum(tokens) / measured if times and measured > 0 and None not in tokens else None
        ),
        median_step_seconds=statistics.median(times) if times else None,
        wall_seconds=wall,
        peak_memory_bytes=cuda_peak if cuda_peak is not None else (max(rss) if rss else None),
        peak_memory_source="cuda_allocator"
        if cuda_peak is not None
        else ("process_rss" if rss else None),
        state_bytes=figures.get("state"),
        max_abs_activation=figures.get("activation"),
        max_abs_gradient=figures.get("max_gradient"),
        skipped_steps=getattr(mode, "skipped_steps", 0),
        final_loss_scale=mode.loss_scale if hasattr(mode, "loss_scale") and mode.scaler else None,
        heldout_losses=tuple(figures.get("heldout", ())),
        eval_score=figures.get("eval"),
        speed_is_meaningful=not spec.emulate,
    )
