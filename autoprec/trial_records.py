"""What a trial measured: the records that cross into the drift gate, the study and the
profile, and the summaries of held-out outputs the gate compares."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from pydantic import BaseModel

from autoprec._models import FROZEN_RECORD
from autoprec.recipe import LrPoint
from autoprec.specs import ModeSpec

FailureKind = Literal[
    "unsupported", "exception", "out_of_memory", "compile_failed", "eval_failed",
    "non_finite_loss", "non_finite_gradient", "non_finite_weight",
]  # fmt: skip

OUTPUT_SAMPLE_ELEMENTS = 2**16
"""Values of each held-out output kept (evenly strided, fp32, on the host) to compare outputs,
beside one argmax per row: an 8 x 2048 x 128k logits batch is 8.4 GB in fp32, its summary
under 0.5 MB. The relative L2 error over 65k evenly spread values estimates the full one."""


class StepWindow(BaseModel):
    """Optimizer steps timed as one block, as a training loop that logs every few steps runs
    them: no host synchronization inside (losses, non-finite checks and gradient maxima stay
    on the device), one clock read at each end (CUDA events on a GPU) and one host read of the
    window's figures after it."""

    model_config = FROZEN_RECORD

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
    pass_seconds: tuple[float, ...] = ()
    """Each forward-and-backward pass before the timed windows (a pass settling amp_fp16's loss
    scale, a warm-up step) of an eager run: the fastest is a floor on its step time known
    before any window is timed (``search._warmup_pace``). Empty for a compiled run, whose
    first passes compile."""


StopCheck = Callable[[TrialProgress], "str | None"]
"""Returns a reason to stop the trial early (budget, cannot win), or None to go on."""


class TrialFailure(BaseModel):
    model_config = FROZEN_RECORD

    kind: FailureKind
    step: int | None
    message: str
    raised_in: str | None = None
    """Where the exception was raised: the innermost frame in autoprec or in code outside any
    installed library (the user's model, loss or loader), as ``path:line in function``."""

    raised_by_autoprec: bool = False
    """The innermost frame of the traceback is autoprec's own code (not torch's, called from
    autoprec with the user's model, loss or batches): a defect of autoprec's."""

    def located(self) -> str:
        """The message and where it was raised."""
        where = "" if self.raised_in is None else f" (raised in {self.raised_in})"
        return f"{self.message.rstrip('.')}{where}"

    def reason(self) -> str:
        """The failure as a verdict's reason: kind, step, message and where it was raised."""
        step = "" if self.step is None else f" at step {self.step}"
        return f"{self.kind.replace('_', ' ')}{step}: {self.located()}"


class StateBytes(BaseModel):
    """Exact bytes of parameters, gradients and optimizer state (Kahan buffers, 8-bit states)."""

    model_config = FROZEN_RECORD

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


class LowPrecisionMoment(BaseModel):
    """An Adam second moment (``exp_avg_sq``) the optimizer keeps in bf16."""

    model_config = FROZEN_RECORD

    dtype: str
    rounding: Literal["nearest", "stochastic"]
    beta2: float
    """The largest beta2 of the groups holding such states."""
    elements: int


class TrialRecord(BaseModel):
    """The figures of one trial: what crosses into the drift gate, the study and the profile."""

    model_config = FROZEN_RECORD

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
    """Largest finite |output| of any leaf module not kept in fp32, and of any op computing in
    fp16 (inside a module with children too: attention scores), over the held-out batches
    (fp16 overflow risk)."""
    infinite_activation_leaves: tuple[str, ...] | None = None
    """The leaf modules (not kept in fp32) whose output held an infinity on a held-out batch:
    in fp16, an overflow that ``max_abs_activation`` (finite values only) hides. Names, not a
    count: the reference watches every leaf, a trial with ``keep_fp32`` fewer, and a kept
    mask's deliberate -inf in the reference cancelled an overflow in the trial (a hunt)."""
    max_abs_gradient: float | None = None
    """Largest |gradient| of the parameters not kept in fp32 over the trial, loss scaling
    removed."""
    skipped_steps: int = 0
    final_loss_scale: float | None = None
    settled_loss_scale: float | None = None
    """amp_fp16's loss scale after settling, before the first step (None in other modes and
    in records written before it was kept)."""
    heldout_losses: tuple[float, ...] = ()
    heldout_losses_fp32_read: tuple[float, ...] = ()
    """The held-out losses of the trial's own trained weights read by the user's model in plain
    fp32 (empty for fp32 itself): against ``heldout_losses``, the mode's forward-pass cost alone,
    free of seed noise (the same weights, the same batches)."""
    row_constants_ignored: bool | None = None
    """fp32 runs: whether the loss ignores a constant added to a row of the prediction
    (``trial_loop.ignores_row_constants``); None where not read."""
    fp32_read_failure: str | None = None
    """Why that fp32 read did not run where it was tried (the copy did not fit in memory, or
    the read raised: its error), said in the verdict's notes."""
    eval_score: float | None = None
    speed_is_meaningful: bool = True
    """False for emulated FP8: its numerics are real, its speed is not."""
    lr_points: tuple[LrPoint, ...] = ()
    """The learning rates of the trial's legs, in the order trained."""
    low_precision_moment: LowPrecisionMoment | None = None
    """Adam's second moment when the optimizer keeps it in bf16 (read after the first step)."""
    nearest_adam_beta2: float | None = None
    """bf16_pure trained by an Adam: the largest beta2 of its groups holding bf16 weights,
    wherever the optimizer keeps the moments (bf16, or bitsandbytes' 8-bit states; read after
    the first step). The optimizer-state rule reads it (``drift_state_rule``)."""
    nearest_rounded_decay: float | None = None
    """The smallest lr x weight_decay per step of decoupled weight decay applied to bf16 weights
    by its own nearest-rounded multiply (bf16_pure with AdamW; read after the first step)."""
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
    """argmax over the last dimension for up to ``OUTPUT_SAMPLE_ELEMENTS`` rows at evenly
    strided positions (None when there is no class dimension)."""


def sample_stride(count: int) -> int:
    """The stride that takes at most ``OUTPUT_SAMPLE_ELEMENTS`` of ``count`` positions, spread
    over all of them: rounded up (rounded down, [:65536] cut the tail: an 8 x 16000 output
    kept rows 0-4, and a mode that changed only the last rows read as equal; found by a
    hunt)."""
    return max(1, -(-count // OUTPUT_SAMPLE_ELEMENTS))


def summarize_output(output: torch.Tensor) -> OutputSummary:
    """Reduce an output on its device, then copy only the summary to the host: a copy, never a
    view (an fp32 output already on the host came back as a strided view that held, and saved
    to the references file, the whole output: 250 MB of logits a held-out batch; the argmax
    of every row, 16 MB for 2M rows; found by a hunt)."""
    detached = output.detach()
    flat = detached.reshape(-1)
    values = flat[:: sample_stride(flat.numel())].to("cpu", torch.float32, copy=True)
    top1 = None
    if detached.dim() >= 2 and detached.shape[-1] > 1:
        rows = detached.reshape(-1, detached.shape[-1])
        top1 = rows[:: sample_stride(rows.shape[0])].argmax(-1).to("cpu", copy=True)
    return OutputSummary(shape=tuple(detached.shape), values=values, top1=top1)


class StateDigest(NamedTuple):
    """A tensor of state outside the optimizer, summarised: its dtype and two float64 sums
    (training changed it when they differ)."""

    dtype: str
    total: float
    norm: float


@dataclass
class TrialResult:
    """A record plus what the drift gate compares: sampled weights and held-out outputs."""

    record: TrialRecord
    leg_weights: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Sampled weights (fp32, Kahan buffers added) before training and after each lr leg."""
    sample_indices: dict[str, torch.Tensor] = field(default_factory=dict)
    parameter_groups: dict[str, int] = field(default_factory=dict)
    """Index of the optimizer's parameter group each sampled tensor trains in (the movement
    check judges groups of different lrs apart); empty: judged as one."""
    heldout_outputs: list[OutputSummary | None] = field(default_factory=list)
    outside_state: list[dict[str, StateDigest]] = field(default_factory=list)
    """Floating buffers and frozen floating weights (state no optimizer steps), summarised
    before training, after its first step and after the last (two entries in results stored
    before the middle one was kept): the drift gate's state check (``drift_outside_state``)."""
    tail_seconds: float = 0.0
    """Seconds the run spent after its last step: the held-out pass and ``eval_fn``."""

    def moved(self) -> bool:
        """Did training change any sampled weight?"""
        if len(self.leg_weights) < 2:
            return False
        first, last = self.leg_weights[0], self.leg_weights[-1]
        return any(not torch.equal(first[name], last[name]) for name in first)
