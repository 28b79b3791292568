"""One short, measured training run of a mode on a deep copy of the user's model.

Every trial starts from the same weights (a deep copy; the user's model, its grads and the RNG
states are left exactly as they were), the same seed and the same batches as the fp32
reference. Failures (out of memory, an exception in the model, a non-finite loss, gradient or
weight) are recorded with the step and message, never raised; memory is freed afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Collection, Sequence
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
from autoprec.layers import storage_key
from autoprec.plan import PrecisionPlan, build_plan
from autoprec.recipe import LrPoint, TrainingRecipe
from autoprec.specs import ModeSpec

FailureKind = Literal[
    "unsupported", "exception", "out_of_memory", "compile_failed",
    "non_finite_loss", "non_finite_gradient", "non_finite_weight",
]  # fmt: skip

MOVEMENT_SAMPLE_ELEMENTS = 2**20
"""Weight elements sampled (evenly across tensors) to measure how far training moved them."""

OUTPUT_SAMPLE_ELEMENTS = 2**16
"""Values of each held-out output kept (evenly strided, fp32, on the host) to compare outputs,
beside one argmax per row: an 8 x 2048 x 128k logits batch is 8.4 GB in fp32, its summary
under 0.5 MB. The relative L2 error over 65k evenly spread values estimates the full one."""

MAX_WINDOW_STEPS = 10
"""Most optimizer steps timed as one window. A window ends in one host read, as a loop that
logs its loss every 10 steps does (torchtitan's default ``log_freq``); longer windows would
measure CPU/GPU overlap no better and give fewer windows to take a median over."""

MIN_WINDOWS = 5
"""Fewest measured windows a trial aims for: shorter trials time shorter windows."""

_COMPENSATION_KEYS = ("kahan_comp", "compensation")  # torch-optimi, StochasticAdamW


class StepWindow(BaseModel):
    """Optimizer steps timed as one block, as a training loop that logs every few steps runs
    them: no host synchronization inside (losses, non-finite checks and gradient maxima stay
    on the device), one clock read at each end (CUDA events on a GPU) and one host read of the
    window's figures after it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    first_step: int
    steps: int
    seconds: float
    samples: int
    tokens: int | None
    warmup: bool
    """Warm-up (first steps, compilation included): counted in the budget, not in speed."""

    @property
    def step_seconds(self) -> float:
        """Mean seconds per optimizer step over the window."""
        return self.seconds / self.steps


def measured_windows(windows: Sequence[StepWindow]) -> list[StepWindow]:
    """The windows speed figures come from: all but warm-up."""
    return [window for window in windows if not window.warmup]


@dataclass(frozen=True)
class TrialProgress:
    """What a stop check sees after each window of steps."""

    step: int
    """The last step run."""
    steps_planned: int
    windows: tuple[StepWindow, ...]
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


class LowPrecisionMoment(BaseModel):
    """An Adam second moment (``exp_avg_sq``) the optimizer keeps in bf16."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: str
    rounding: Literal["nearest", "stochastic"]
    beta2: float
    """The largest beta2 of the groups holding such states."""
    elements: int


def _low_precision_moment(plan: PrecisionPlan) -> LowPrecisionMoment | None:
    elements, beta2 = 0, 0.0
    for group in plan.optimizer.param_groups:
        group_beta2 = group["betas"][1] if "betas" in group else group.get("beta2", 0.0)
        for parameter in group["params"]:
            state = plan.optimizer.state.get(parameter, {}).get("exp_avg_sq")
            if isinstance(state, torch.Tensor) and state.dtype == torch.bfloat16:
                elements += state.numel()
                beta2 = max(beta2, float(group_beta2))
    if not elements:
        return None
    return LowPrecisionMoment(
        dtype="bfloat16", rounding=plan.mode.state_rounding, beta2=beta2, elements=elements
    )


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
    """Median over the measured windows of their seconds per optimizer step."""
    windows: tuple[StepWindow, ...] = ()
    """Every timed window of steps, warm-up included, in order."""
    wall_seconds: float = 0.0
    peak_memory_bytes: int | None = None
    """Peak memory of the trial's training alone: the peak over its steps minus what was
    allocated before the trial began (the user's model, batches already on the device, earlier
    trials), read before the held-out pass and ``eval_fn``. CUDA: allocated bytes; CPU: the
    process's resident set, sampled after every window of steps."""
    peak_reserved_bytes: int | None = None
    """CUDA only: the caching allocator's reserved bytes, same baseline: what an OOM answers to."""
    peak_memory_source: Literal["cuda_allocator", "process_rss"] | None = None
    state_bytes: StateBytes | None = None
    activation_bytes: int | None = None
    """CPU, eager: bytes autograd saved for backward in one micro-batch's forward (saved-tensor
    hooks, exact; parameters left out). With ``state_bytes``, what a CPU training step holds at
    its peak beyond temporaries."""
    max_abs_activation: float | None = None
    """Largest |output| of any leaf module not kept in fp32 over the held-out batches (fp16
    overflow risk)."""
    max_abs_gradient: float | None = None
    """Largest |gradient| of the parameters not kept in fp32 over the trial, loss scaling
    removed."""
    skipped_steps: int = 0
    final_loss_scale: float | None = None
    heldout_losses: tuple[float, ...] = ()
    eval_score: float | None = None
    speed_is_meaningful: bool = True
    """False for emulated FP8: its numerics are real, its speed is not."""
    lr_points: tuple[LrPoint, ...] = ()
    """The learning rates of the trial's legs, in the order trained."""
    low_precision_moment: LowPrecisionMoment | None = None
    """Adam's second moment when the optimizer keeps it in bf16 (read after the first step)."""
    leg_steps: tuple[int, ...] = ()
    """Optimizer steps of each leg."""
    fp8_layers: tuple[str, ...] = ()
    """The modules the mode ran in FP8 (FP8 modes: those its filters converted)."""
    compiled_graphs: int | None = None
    """Compiled trials: graphs torch.compile built during warm-up (more than one forward graph
    means graph breaks)."""
    recompiles: int | None = None
    """Compiled trials: graphs built after warm-up (recompiles): their compile time is inside
    the timed windows, so the speed figures are pessimistic; a run that recompiles every few
    steps will in training too."""
    draws_random: bool = False
    """Training drew from the global random streams (dropout, noise in the loss): a run with
    another seed and the same batches would differ."""

    @property
    def completed(self) -> bool:
        """Ran every planned step without failing."""
        return self.failure is None and self.stopped is None


TIMING_FIELDS = (
    "samples_per_second", "tokens_per_second", "median_step_seconds", "wall_seconds",
    "peak_memory_bytes", "peak_reserved_bytes", "windows",
)  # fmt: skip
"""Fields that differ between otherwise identical trials."""


@dataclass(frozen=True)
class OutputSummary:
    """What the gate compares of one held-out output: sampled values and per-row argmax."""

    shape: tuple[int, ...]
    values: torch.Tensor
    """Up to ``OUTPUT_SAMPLE_ELEMENTS`` values at evenly strided positions, fp32, on the host."""
    top1: torch.Tensor | None
    """argmax over the last dimension for every row (None when there is no class dimension)."""


def summarize_output(output: torch.Tensor) -> OutputSummary:
    """Reduce an output on its device, then copy only the summary to the host."""
    detached = output.detach()
    flat = detached.reshape(-1)
    step = max(1, flat.numel() // OUTPUT_SAMPLE_ELEMENTS)
    values = flat[::step][:OUTPUT_SAMPLE_ELEMENTS].float().cpu()
    classes = detached.dim() >= 2 and detached.shape[-1] > 1
    top1 = detached.argmax(-1).reshape(-1).cpu() if classes else None
    return OutputSummary(shape=tuple(detached.shape), values=values, top1=top1)


@dataclass
class TrialResult:
    """A record plus what the drift gate compares: sampled weights and held-out outputs."""

    record: TrialRecord
    leg_weights: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Sampled weights (fp32, Kahan buffers added) before training and after each lr leg."""
    sample_indices: dict[str, torch.Tensor] = field(default_factory=dict)
    heldout_outputs: list[OutputSummary | None] = field(default_factory=list)

    def moved(self) -> bool:
        """Did training change any sampled weight?"""
        if len(self.leg_weights) < 2:
            return False
        first, last = self.leg_weights[0], self.leg_weights[-1]
        return any(not torch.equal(first[name], last[name]) for name in first)


def _sample_indices(model: nn.Module, budget: int) -> dict[str, torch.Tensor]:
    """Which elements of each trainable parameter the movement check follows: all of them
    when the model has at most ``budget`` elements, else a share of each tensor proportional to
    its size, drawn with replacement (duplicates dropped) so that the cost grows with the
    budget, never with the model (a permutation of a 45M-element tensor took 2.2 s)."""
    parameters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for _, p in parameters) or 1
    generator = torch.Generator().manual_seed(0)
    indices = {}
    for name, parameter in parameters:
        size = parameter.numel()
        if total <= budget:
            indices[name] = torch.arange(size)
            continue
        count = max(1, size * budget // total)
        drawn = torch.randint(0, size, (count,), generator=generator)
        indices[name] = torch.unique(drawn)  # sorted
    return indices


def _sampled(plan: PrecisionPlan, indices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sampled weight values in fp32, Kahan compensation included (it is part of the weight)."""
    parameters = dict(plan.model.named_parameters())
    values = {}
    for name, chosen in indices.items():
        parameter = parameters[name]
        where = chosen.to(parameter.device)
        weight = parameter.detach().reshape(-1)[where].float()  # only the sampled elements
        state = plan.optimizer.state.get(parameter, {})
        for key in _COMPENSATION_KEYS:
            compensation = state.get(key)
            if isinstance(compensation, torch.Tensor) and compensation.shape == parameter.shape:
                weight = weight + compensation.detach().reshape(-1)[where].float()
        values[name] = weight.cpu()
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
        gradients=sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
        + plan.mode.accumulation_bytes(),
        optimizer=optimizer,
    )


class _SavedForBackward:
    """Counts the bytes autograd saves for backward during a forward pass (saved-tensor hooks
    see every saved tensor, exactly): each storage once, the parameters' own left out (they
    are state, counted in :class:`StateBytes`). An autocast copy of a weight is counted: it
    is held until backward."""

    def __init__(self, model: nn.Module) -> None:
        self._parameters = {_saved_key(p) for p in model.parameters()}
        self._saved: dict[object, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _saved_key(tensor)
        if key not in self._parameters:
            self._saved[key] = _storage_bytes(tensor)
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._saved.values())


def _saved_key(tensor: torch.Tensor) -> object:
    """The tensor's storage; a wrapper subclass (FP8) without one counts by identity."""
    key = storage_key(tensor)
    return ("tensor", id(tensor)) if key is None else key


def _storage_bytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return tensor.numel() * tensor.element_size()


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _memory_now(device: torch.device) -> dict[str, int]:
    """Memory in use before a trial: CUDA allocated and reserved, or the process's RSS."""
    if device.type == "cuda":
        return {
            "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
        }
    rss = _rss_bytes()
    return {} if rss is None else {"rss": rss}


def _memory_peak(
    device: torch.device, baseline: dict[str, int], rss_samples: list[int | None]
) -> dict[str, Any]:
    """The trial's own peak: the peak since ``baseline`` was taken, minus the baseline (CUDA:
    the allocator's peak counters; CPU: the RSS sampled after every window of steps)."""
    if device.type == "cuda":
        return {
            "allocated": max(0, torch.cuda.max_memory_allocated(device) - baseline["allocated"]),
            "reserved": max(0, torch.cuda.max_memory_reserved(device) - baseline["reserved"]),
            "source": "cuda_allocator",
        }
    samples = [value for value in rss_samples if value is not None]
    if not samples or "rss" not in baseline:
        return {}
    return {"allocated": max(0, max(samples) - baseline["rss"]), "source": "process_rss"}


def _max_abs_gradient(plan: PrecisionPlan, kept: Collection[int] = ()) -> torch.Tensor | None:
    """Largest |gradient| of the parameters not in ``kept`` (ids), loss scaling removed, as a
    device tensor (no host read); None when no such parameter has a gradient."""
    grads = [p.grad for p in plan.model.parameters() if p.grad is not None and id(p) not in kept]
    if not grads:
        return None
    largest = torch.stack(torch._foreach_norm(grads, math.inf)).max().float()
    scale = plan.mode.loss_scale_tensor()
    return largest if scale is None else largest / scale.to(largest.device)


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    """The global random streams a model's forward pass draws from on ``device``."""
    states = [torch.random.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


class _WindowClock:
    """Times a window of steps. On a GPU: CUDA events recorded on the device's current stream,
    waited for once, at the window's end. On a CPU, where ops run as they are called: the host
    clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._started: float = 0.0
        self._start_event: Any = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record(torch.cuda.current_stream(self.device))
        else:
            self._started = time.perf_counter()

    def stop(self) -> float:
        """Seconds since :meth:`start`; on a GPU this waits for the window's work to finish."""
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            end.synchronize()
            return float(self._start_event.elapsed_time(end)) / 1e3
        return time.perf_counter() - self._started


def compiled_graph_count() -> int:
    """Graphs torch.compile (dynamo) has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compile_counts(figures: dict[str, Any], before: int) -> tuple[int | None, int | None]:
    """(graphs built in warm-up, graphs built after it) of a compiled trial."""
    after_warmup = figures.get("graphs_after_warmup")
    if after_warmup is None:
        return None, None
    after_training = figures.get("graphs_after_training", compiled_graph_count())
    return after_warmup - before, after_training - after_warmup


def window_steps_for(steps: int, warmup_steps: int) -> int:
    """Steps per timed window: at most MAX_WINDOW_STEPS, and short enough for MIN_WINDOWS
    windows after warm-up."""
    return max(1, min(MAX_WINDOW_STEPS, (steps - warmup_steps) // MIN_WINDOWS))


def _heldout_pass(
    plan: PrecisionPlan,
    heldout: Sequence[Any],
    device: torch.device,
    loss_fn: LossFn | None,
    train_step: TrainStep | None,
) -> tuple[list[float], list[OutputSummary | None], float]:
    maxima: list[torch.Tensor] = []  # reduced once at the end: no device sync per layer

    def watch(_module: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel():
            maxima.append(output.detach().abs().max().float())

    leaves = [  # modules kept in fp32 run in fp32: their range is not the mode's
        module
        for fqn, module in plan.model.named_modules()
        if next(module.children(), None) is None and not plan.mode.keeps_fp32(fqn)
    ]
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
                outputs.append(None if predicted is None else summarize_output(predicted))
    finally:
        plan.model.train(was_training)
        for handle in handles:
            handle.remove()
    largest = float(torch.stack(maxima).max()) if maxima else 0.0
    return losses, outputs, largest


def _leg_steps(steps: int, points: Sequence[LrPoint]) -> list[int]:
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


class _Loop:
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
        self.device, self.clock = device, _WindowClock(device)
        self.figures: dict[str, Any] = {
            "losses": [], "windows": [], "rss": [], "max_gradient": 0.0,
        }  # fmt: skip
        self.micro = 0
        self.current_step: int | None = None
        self.kept = plan.mode.parameter_ids(plan.model, plan.mode.kept_roots(plan.model))
        self.counts_activations = device.type == "cpu" and not plan.spec.compile
        """Count the bytes saved for backward (CPU memory objective) on the first micro-batch;
        on a GPU the allocator's peak holds them already, and compiled graphs save inside
        the compiled function."""
        self._losses: list[torch.Tensor] = []  # this window's, on the device
        self._gradients: list[torch.Tensor | None] = []
        self._samples, self._tokens = 0, 0

    def run_window(self, first_step: int, steps: int, warmup: bool) -> TrialFailure | None:
        """Steps ``first_step`` to ``first_step + steps - 1``, timed as one window; the
        window's failure (non-finite loss or gradient, at the step it first appeared) or None."""
        self._losses, self._gradients = [], []
        self._samples, self._tokens = 0, 0
        self.clock.start()
        for step in range(first_step, first_step + steps):
            self.step(step)
        seconds = self.clock.stop()
        if self.device.type == "cpu":  # after the clock: reading /proc is not the mode's time
            self.figures["rss"].append(_rss_bytes())
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

    def step(self, step: int) -> None:
        """One optimizer step. Nothing is read back to the host: the loss and the gradient
        maximum stay on the device until the window's end."""
        self.current_step = step
        plan, accumulation = self.plan, self.recipe.grad_accumulation_steps
        losses: list[torch.Tensor] = []
        for micro in range(accumulation):
            batch = self.batches[self.order[self.micro % len(self.batches)]]
            batch = to_device(batch, self.device)
            self.micro += 1
            counting = self.micro == 1 and self.counts_activations
            saved = _SavedForBackward(plan.model) if counting else None
            hooks = (
                torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
                if saved is not None
                else contextlib.nullcontext()
            )
            with hooks, plan.autocast():
                loss, _ = forward_and_loss(plan, batch, self.recipe.loss_fn, self.recipe.train_step)
            if saved is not None:  # the first micro-batch, a warm-up step: not timed
                self.figures["activation_bytes"] = saved.bytes
            losses.append(loss.detach().float().reshape(()))
            self._samples += count_samples(batch)
            counted = count_tokens(batch)
            if counted is None or self._tokens is None:
                self._tokens = None
            else:
                self._tokens += counted
            if micro < accumulation - 1:
                plan.step(loss)  # backward; an accumulation micro-batch does not step
            else:
                plan.backward(loss)
        self._losses.append(torch.stack(losses).mean())
        self._gradients.append(_max_abs_gradient(plan, self.kept))
        stepped = plan.step()
        self.figures["steps_done"] = step + 1
        if stepped and "state" not in self.figures:  # steady state: after a real step
            self.figures["state"] = _state_bytes(plan)
            self.figures["moment"] = _low_precision_moment(plan)

    def _read_window(self, first_step: int) -> TrialFailure | None:
        """The window's one host read: its losses and gradient maxima, checked for non-finite
        values (the loss scaler handles amp_fp16's inf/nan gradients)."""
        zero = torch.zeros((), device=self._losses[0].device)
        gradients = [zero if g is None else g.to(zero.device) for g in self._gradients]
        losses, maxima = torch.stack([torch.stack(self._losses), torch.stack(gradients)]).tolist()
        for offset, (loss, gradient) in enumerate(zip(losses, maxima, strict=True)):
            step = first_step + offset
            self.figures["losses"].append(loss)
            if not math.isfinite(loss):
                return TrialFailure(
                    kind="non_finite_loss", step=step, message=f"loss is {loss} at step {step}"
                )
            if not math.isfinite(gradient) and self.plan.spec.mode != "amp_fp16":
                message = f"gradient is {gradient} at step {step}"
                return TrialFailure(kind="non_finite_gradient", step=step, message=message)
            if math.isfinite(gradient):
                self.figures["max_gradient"] = max(self.figures["max_gradient"], gradient)
        return None

    def progress(self, step: int, steps: int) -> TrialProgress:
        state = self.figures.get("state")
        return TrialProgress(
            step=step,
            steps_planned=steps,
            windows=tuple(self.figures["windows"]),
            state_bytes=None if state is None else state.total,
        )


def _settle(loop: _Loop, device: torch.device) -> None:
    """Let the mode calibrate on the first batch (amp_fp16 settles its loss scale) without
    stepping and without moving the model's random stream."""
    plan, recipe = loop.plan, loop.recipe

    def compute_loss() -> torch.Tensor:  # called only by modes that calibrate
        batch = to_device(loop.batches[loop.order[0]], device)
        with plan.autocast():
            loss, _ = forward_and_loss(plan, batch, recipe.loss_fn, recipe.train_step)
        return loss / recipe.grad_accumulation_steps

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        plan.mode.settle(compute_loss, plan.model)


def _measure_trained(
    loop: _Loop,
    heldout: Sequence[Any],
    eval_fn: Callable[[nn.Module], float] | None,
) -> list[OutputSummary | None]:
    """Held-out losses, outputs and activation range, and ``eval_fn``, on the trained copy."""
    plan, figures, recipe = loop.plan, loop.figures, loop.recipe
    losses, outputs, activation = _heldout_pass(
        plan, heldout, loop.device, recipe.loss_fn, recipe.train_step
    )
    figures["heldout"] = losses
    figures["activation"] = activation if heldout else None
    if eval_fn is not None:
        plan.model.eval()
        with torch.no_grad(), plan.autocast():
            figures["eval"] = float(eval_fn(plan.model))
        plan.model.train()
    return outputs


def _is_compile_error(error: BaseException) -> bool:
    """An error raised by torch.compile's tracer (dynamo) or compiler (inductor)."""
    return type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))


def _failure_of(error: Exception, step: int | None) -> TrialFailure:
    if isinstance(error, UnsupportedModeError):
        return TrialFailure(
            kind="unsupported", step=None, message="; ".join(error.reasons) or str(error)
        )
    kind: FailureKind = "out_of_memory" if _is_oom(error) else "exception"
    message = f"{type(error).__name__}: {_first_line(error)}"
    if kind == "exception" and _is_compile_error(error):
        kind = "compile_failed"
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is not None:  # the compiler's own error says what failed
            message += f" {type(inner).__name__}: {_first_line(inner)}"
        message = f"torch.compile failed: {message} (run this mode eager: compile=False)"
    return TrialFailure(kind=kind, step=step, message=message)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def _train(
    loop: _Loop,
    result: TrialResult,
    points: Sequence[LrPoint],
    legs: list[int],
    warmup_steps: int,
    window_steps: int,
    stop: StopCheck | None,
) -> tuple[TrialFailure | None, str | None]:
    """Train every leg at its learning rates, in windows of steps (the warm-up steps form
    their own window; no window crosses a leg); (failure, stop reason). ``loop.current_step``
    is the last step run."""
    step, total = 0, sum(legs)
    for point, leg in zip(points, legs, strict=True):
        _set_lrs(loop.plan.optimizer, point)
        leg_end = step + leg
        while step < leg_end:
            warmup = step < warmup_steps
            end = min(leg_end, warmup_steps if warmup else step + window_steps)
            failure = loop.run_window(step, end - step, warmup)
            step = end
            if failure is not None:
                return failure, None
            if stop is not None:
                reason = stop(loop.progress(step - 1, total))
                if reason is not None:
                    return None, reason
        result.leg_weights.append(_sampled(loop.plan, result.sample_indices))
    return None, None


def _uncopyable_attribute(model: nn.Module) -> str | None:
    """``module.attribute (type)`` of the first attribute that copy.deepcopy refuses."""
    for name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if attribute in ("_parameters", "_buffers", "_modules"):
                continue
            try:
                copy.deepcopy(value)
            except Exception:  # noqa: BLE001 - looking for the one that fails
                where = f"{name}.{attribute}" if name else attribute
                return f"{where} ({type(value).__name__})"
    return None


def _compiled_forward(module: nn.Module) -> bool:
    """A compiled ``forward`` set on the instance (what ``plan.compile_model`` does)."""
    return hasattr(vars(module).get("forward"), "_torchdynamo_orig_callable")


def compiled_in_place(model: nn.Module) -> bool:
    """Is any module compiled in place (``nn.Module.compile()`` or a compiled ``forward``)?"""
    return any(
        getattr(module, "_compiled_call_impl", None) is not None or _compiled_forward(module)
        for module in model.modules()
    )


def _uncompiled(model: nn.Module) -> nn.Module:
    """Drop in-place compilation from a copy: the copied compiled callable would still run the
    original."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
        if _compiled_forward(module):
            del module.forward
    return model


def deep_copy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` without in-place compilation, or a TypeError naming the
    attribute that cannot be copied."""
    try:
        return _uncompiled(copy.deepcopy(model))
    except Exception as error:
        culprit = _uncopyable_attribute(model)
        found = f"; the attribute {culprit} cannot be copied" if culprit else ""
        raise TypeError(
            f"autoprec trains copies of your model (copy.deepcopy), and copying "
            f"{type(model).__name__} failed ({type(error).__name__}: {error}){found}. Keep "
            "locks, files, open connections and loggers out of the model's attributes (create "
            "them outside it, or define __deepcopy__)."
        ) from error


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
    eval_fn: Callable[[nn.Module], float] | None
    stop: StopCheck | None


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
    return torch.randperm(count, generator=torch.Generator().manual_seed(shuffle_seed)).tolist()


def _constant_point(plan: PrecisionPlan) -> LrPoint:
    """One leg at the optimizer's own learning rates."""
    lrs = tuple(float(group["lr"]) for group in plan.optimizer.param_groups)
    return LrPoint(role="constant", lrs=lrs)


def _plan_for(inputs: _TrialInputs) -> PrecisionPlan:
    """A deep copy of the model in train mode, in the trial's mode, with the recipe's optimizer."""
    trained = deep_copy(inputs.model).train()
    recipe = inputs.recipe
    return build_plan(
        inputs.spec,
        trained,
        recipe.make_optimizer(inputs.model, trained),
        grad_accumulation_steps=recipe.grad_accumulation_steps,
        clip_grad_norm=recipe.clip_grad_norm,
        situation=inputs.situation,
    )


def _train_legs(
    loop: _Loop, inputs: _TrialInputs, run: _CopyRun, result: TrialResult, baseline: dict[str, int]
) -> None:
    """Train every leg, sampling the weights before and after each; note whether training drew
    random numbers, its peak memory and a weight left non-finite."""
    plan, device = loop.plan, inputs.device
    result.sample_indices = _sample_indices(plan.model, MOVEMENT_SAMPLE_ELEMENTS)
    result.leg_weights.append(_sampled(plan, result.sample_indices))
    before = _rng_states(device)
    run.failure, run.stopped = _train(
        loop, result, run.points, inputs.legs, inputs.warmup_steps, inputs.window_steps, inputs.stop
    )
    if inputs.spec.compile:  # the held-out pass (eval mode, no grad) compiles graphs of its own
        loop.figures["graphs_after_training"] = compiled_graph_count()
    after = _rng_states(device)
    run.draws_random = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # the peak before the held-out pass and eval_fn, which are not the mode's
    loop.figures["peak"] = _memory_peak(device, baseline, loop.figures["rss"])
    if run.failure is None and not all(
        bool(torch.isfinite(p).all()) for p in plan.model.parameters()
    ):
        step = loop.current_step
        message = f"weights are not finite after step {step}"
        run.failure = TrialFailure(kind="non_finite_weight", step=step, message=message)


def _train_copy(inputs: _TrialInputs, result: TrialResult, baseline: dict[str, int]) -> _CopyRun:
    """Train and measure a deep copy of the model; a failure is recorded in the run, never
    raised, and the copy's memory is freed."""
    run = _CopyRun()
    plan: PrecisionPlan | None = None
    loop: _Loop | None = None
    try:
        if inputs.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(inputs.device)
        plan = _plan_for(inputs)
        run.mode = plan.mode
        run.points = inputs.points or (_constant_point(plan),)
        run.fp8_layers = plan.mode.fp8_modules(plan.model)
        loop = _Loop(plan, inputs.recipe, inputs.batches, inputs.order, inputs.device)
        run.figures = loop.figures
        _settle(loop, inputs.device)
        _train_legs(loop, inputs, run, result, baseline)
        if run.failure is None and run.stopped is None:
            result.heldout_outputs = _measure_trained(loop, inputs.heldout, inputs.eval_fn)
        if "state" not in loop.figures:  # no step stepped: measure what there is
            loop.figures["state"] = _state_bytes(plan)
    except Exception as error:  # noqa: BLE001 - a failing trial is data, not a crash
        run.failure = _failure_of(error, loop.current_step if loop is not None else None)
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
    eval_fn: Callable[[nn.Module], float] | None = None,
    warmup_steps: int = 2,
    window_steps: int | None = None,
    seed: int = 0,
    shuffle_seed: int | None = None,
    situation: Situation | None = None,
    stop: StopCheck | None = None,
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
            they are timed as one window of their own.
        window_steps: steps per timed window (default: :func:`window_steps_for`). Speed
            figures are medians over windows; nothing is read back to the host inside one.
        shuffle_seed: train on the batches in a seeded random order (the noise reference).
        stop: called after every step; a returned reason ends the trial early (not judged).
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
        legs=_leg_steps(steps, points) if points else [steps],
        warmup_steps=warmup_steps,
        window_steps=window_steps or window_steps_for(steps, warmup_steps),
        heldout=heldout,
        eval_fn=eval_fn,
        stop=stop,
    )
    device = inputs.device
    started = time.perf_counter()
    result = TrialResult(
        record=TrialRecord(
            spec=spec, seed=seed, steps_planned=steps, steps_run=0, warmup_steps=warmup_steps
        )
    )
    baseline = _memory_now(device)  # what is not this trial: subtracted from its peak
    graphs_before = 0
    if spec.compile:
        torch.compiler.reset()  # compile from scratch, as a fresh training process does
        graphs_before = compiled_graph_count()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        run = _train_copy(inputs, result, baseline)
    if "peak" not in run.figures:  # failed or stopped before the end: the peak so far
        run.figures["peak"] = _memory_peak(device, baseline, run.figures.get("rss", []))
    result.record = _record(inputs, seed, steps, run, graphs_before, time.perf_counter() - started)
    return result


def _steps_run(failure: TrialFailure | None, steps_done: int) -> int:
    """Steps that ran cleanly: a non-finite loss or gradient is found when its window is read,
    after the rest of the window ran on; the steps from the failing one on do not count."""
    if failure is not None and failure.kind in ("non_finite_loss", "non_finite_gradient"):
        return min(steps_done, failure.step or 0)
    return steps_done


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
    measured = measured_windows(windows)
    seconds = sum(window.seconds for window in measured)
    tokens = [window.tokens for window in measured]
    peak = figures.get("peak") or {}
    graphs, recompiles = _compile_counts(figures, graphs_before)
    return TrialRecord(
        spec=spec,
        seed=seed,
        steps_planned=steps,
        steps_run=_steps_run(run.failure, figures.get("steps_done", 0)),
        warmup_steps=inputs.warmup_steps,
        failure=run.failure,
        losses=tuple(figures.get("losses", [])),
        samples_per_second=(
            sum(window.samples for window in measured) / seconds if seconds > 0 else None
        ),
        tokens_per_second=(
            sum(tokens) / seconds  # type: ignore[arg-type]
            if seconds > 0 and None not in tokens
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
        max_abs_gradient=figures.get("max_gradient"),
        skipped_steps=getattr(mode, "skipped_steps", 0),
        final_loss_scale=mode.loss_scale if hasattr(mode, "loss_scale") and mode.scaler else None,
        heldout_losses=tuple(figures.get("heldout", ())),
        low_precision_moment=figures.get("moment"),
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
