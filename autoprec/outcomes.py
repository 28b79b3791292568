"""A candidate's outcome as the study stores it, and the objectives that rank outcomes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from autoprec._models import FROZEN_RECORD
from autoprec.specs import ModeSpec
from autoprec.trial_records import StepWindow

Objective = Literal["speed", "memory", "balanced"]
OBJECTIVES: tuple[Objective, ...] = ("speed", "memory", "balanced")
TrialStatus = Literal["accepted", "rejected", "pruned", "failed", "stopped"]
"""``stopped``: only the quality screen's (``check(max_trial_minutes=)``) trial time limit; a
tune trial past its budget is ``pruned``."""
MemoryKind = Literal["cuda_peak", "state_bytes", "state_and_activations"]
"""What ``TrialOutcome.memory_bytes`` counts: the CUDA allocator's peak (GPU); on a CPU the
exact parameter + gradient + optimizer-state bytes, plus the bytes saved for backward when they
were measured (eager trials)."""
CPU_MEMORY_KINDS = ("state_bytes", "state_and_activations")


class TrialOutcome(BaseModel):
    """One candidate's result, as the study stores it (JSON in ``user_attrs``)."""

    model_config = FROZEN_RECORD

    spec: ModeSpec
    status: TrialStatus
    reasons: tuple[str, ...] = ()
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    median_step_seconds: float | None = None
    memory_bytes: int | None = None
    memory_kind: MemoryKind | None = None
    activation_bytes: int | None = None
    """CPU, eager: bytes saved for backward, included in ``memory_bytes``."""
    compiled_graphs: int | None = None
    """Compiled trials: graphs torch.compile built during warm-up (more than one forward graph
    means graph breaks)."""
    recompiles: int | None = None
    """Compiled trials: graphs torch.compile built after warm-up (their time is in the speed)."""
    seconds: float = 0.0
    steps: int = 0
    drift: dict[str, float] = Field(default_factory=dict)
    final_loss: float | None = None
    fp8_layers: tuple[str, ...] = ()
    """The modules the trial ran in FP8."""
    windows: tuple[StepWindow, ...] = ()
    """The trial's timed windows of steps (warm-up included), in order: trials train on the
    same batches in the same order, so the window over steps i..j of two trials is the same
    work (paired pruning)."""
    retimed: bool = False
    """Its speed figures are the means of side-by-side re-timings (``retiming``), not its
    trial's: only re-timed modes compete on speed once any was re-timed."""
    timing_noise: float | None = None
    """Re-timed modes: the relative difference between its own re-timings (or round means):
    another mode within the larger of the two modes' noises counts as equally fast."""
    gate_notes: tuple[str, ...] = ()
    """What the drift gate found without rejecting the mode, and checks it could not run (the
    verdict's notes: "weight decay never applies", "weight movement not judged")."""

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def notes(self) -> tuple[str, ...]:
        """What to know beside the verdict (shown with the reasons)."""
        recompiled = (
            (
                f"recompiled {self.recompiles}x after warm-up (compile time is in its speed; "
                "a run that recompiles will in training too)",
            )
            if self.recompiles
            else ()
        )
        return (*recompiled, *self.gate_notes)

    @property
    def state_bytes(self) -> int | None:
        """CPU: parameter + gradient + optimizer-state bytes (memory less activations)."""
        if self.memory_kind not in CPU_MEMORY_KINDS or self.memory_bytes is None:
            return None
        return self.memory_bytes - (self.activation_bytes or 0)


def balanced_gain(outcome: TrialOutcome, reference: TrialOutcome) -> float:
    """The balanced objective's score: speed-up times memory saving against ``reference``."""
    speedup = (outcome.samples_per_second or 0.0) / (reference.samples_per_second or 1.0)
    return speedup * memory_saving(outcome, reference)


def memory_saving(outcome: TrialOutcome, reference: TrialOutcome) -> float:
    """The reference's memory over the outcome's (1 when either is unknown)."""
    reference_memory = reference.memory_bytes or 1
    return reference_memory / max(outcome.memory_bytes or reference_memory, 1)
