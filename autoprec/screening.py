"""check(): the quality screen. Every mode whose numerics run here goes through the drift gate,
whatever its speed: "would pure bf16 hurt my model?", "would FP8 hurt it?" (torchao's FP8
emulated where the hardware has none) — questions ``tune()`` cannot answer on a machine where
those modes are slow, because it prunes them for speed before the gate sees them.

Same inputs as ``tune()`` (the training recipe included), same fp32 reference and noise run, same
gate; no study, no speed ranking, no profile.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field
from torch import nn

from autoprec._models import FROZEN_RECORD
from autoprec.batching import EvalFn, LossFn, TrainStep
from autoprec.candidates import Skipped, screen_specs
from autoprec.drift import Fp32Runs, shown_forward_cost
from autoprec.drift_blind_spots import blind_spots
from autoprec.drift_thresholds import DriftThresholds
from autoprec.interrupts import raise_if_interrupted
from autoprec.outcomes import TrialOutcome
from autoprec.recipe import (
    OptimizerSource,
    RecipeSummary,
    SchedulerFactory,
    TrainingRecipe,
    default_optimizer,
)
from autoprec.run_inputs import (
    callers_process_kept,
    checked_keep_fp32,
    checked_model,
    device_name,
    resolve_thresholds,
)
from autoprec.run_setup import (
    RunSetup,
    calibration_run,
    progress_callback,
    reference_runs,
    setup_notes,
    setup_run,
    short_trial_notes,
)
from autoprec.search import make_stop_check
from autoprec.search_events import EventSink, SearchEvent
from autoprec.specs import ModeSpec
from autoprec.trial_records import StopCheck, TrialProgress, TrialResult

SCREEN_STEPS = 200
"""Optimizer steps per mode by default: within tune()'s trial lengths (20-300), so a verdict
here is the verdict tune() would reach with time to run the mode."""

ScreenStatus = Literal["safe", "unsafe", "failed", "stopped"]


class ScreenVerdict(BaseModel):
    """One mode's quality verdict: safe (passed the gate), unsafe (rejected), failed (crashed),
    stopped (not judged: its trial passed ``max_trial_minutes``)."""

    model_config = FROZEN_RECORD

    spec: ModeSpec
    status: ScreenStatus
    reasons: tuple[str, ...] = ()
    drift: dict[str, float] = Field(default_factory=dict)
    blind_spots: tuple[str, ...] = ()
    """A safe verdict's known limits: harm that shows only after a longer run than the
    trial's, with the figures it was measured by (see autoprec.drift_blind_spots)."""
    notes: tuple[str, ...] = ()
    """What the gate found without rejecting the mode, and checks it could not run (the
    drift verdict's notes; those every mode shares are also the report's checks_not_run)."""
    steps: int = 0
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return self.spec.label


class QualityReport(BaseModel):
    """What check() found: a verdict per mode, and the modes it could not run here."""

    model_config = FROZEN_RECORD

    verdicts: tuple[ScreenVerdict, ...]
    not_checked: tuple[Skipped, ...]
    """Modes whose numerics cannot run on this machine (TF32, Transformer Engine), with why."""
    steps: int
    device: str
    recipe: RecipeSummary
    checks_not_run: tuple[str, ...] = ()
    seconds: float

    def verdict(self, label: str) -> ScreenVerdict:
        """The verdict of the mode with this label (e.g. ``"bf16_pure"``)."""
        for verdict in self.verdicts:
            if verdict.label == label:
                return verdict
        known = ", ".join(v.label for v in self.verdicts)
        raise KeyError(f"No verdict for {label!r}; checked: {known}.")

    def own_notes(self, verdict: ScreenVerdict) -> list[str]:
        """``verdict``'s notes but those every mode shares (``checks_not_run``, said once)."""
        return [note for note in verdict.notes if note not in self.checks_not_run]

    def summary(self) -> str:
        """A plain-text table: every mode, safe / unsafe / failed / stopped, every reason."""
        lines = [f"quality screen: {self.steps} steps per mode on {self.device}"]
        for verdict in self.verdicts:
            shown = shown_forward_cost(verdict.drift)
            forward = f" (forward cost {shown})" if shown else ""
            lines.append(f"{verdict.label:42} {verdict.status}{forward}")
            if verdict.spec.keep_fp32:
                lines.append(f"    kept in fp32: {', '.join(verdict.spec.keep_fp32)}")
            lines.extend(f"    {reason}" for reason in verdict.reasons)
            lines.extend(f"    not seen by a short trial: {spot}" for spot in verdict.blind_spots)
            lines.extend(f"    note: {note}" for note in self.own_notes(verdict))
        for skipped in self.not_checked:
            lines.append(f"{skipped.spec.label:42} not checked: {'; '.join(skipped.reasons)}")
        lines.extend(f"note: {note}" for note in self.checks_not_run)
        return "\n".join(lines)


def time_limit(
    limit_minutes: float | None, clock: Callable[[], float] = time.monotonic
) -> StopCheck | None:
    """``max_trial_minutes`` for one trial, started now: tune's budget stop with the limit as
    its deadline (``search.make_stop_check``: a pass alone stops a run only when it outlasts
    the time left, as it may be a stall; from two on, a pace that would take over twice the
    time left). None without a limit. check() has no budget otherwise, and a mode without fast
    kernels can take very long (on a CPU amp_fp16's step of ``examples.small_convnet`` took
    15-17 s, fp32's 0.11-0.19 s: about 50 minutes for 200 steps)."""
    if limit_minutes is None:
        return None
    budget = make_stop_check(None, "speed", deadline=clock() + 60 * limit_minutes, clock=clock)

    def stop(progress: TrialProgress) -> str | None:
        reason = budget(progress)
        if reason is None:
            return None
        return (
            f"stopped by max_trial_minutes={limit_minutes:g} after {progress.step + 1} of "
            f"{progress.steps_planned} steps ({reason.removeprefix('budget: ')}): check it "
            "where it runs fast, or raise the limit (max_trial_minutes= in Python, "
            "--max-trial-minutes on the command line)"
        )

    return stop


def _screen(
    setup: RunSetup,
    spec: ModeSpec,
    index: int,
    steps: int,
    references: Fp32Runs,
    limit_minutes: float | None = None,
) -> tuple[ScreenVerdict, TrialResult]:
    raise_if_interrupted()  # a Ctrl-C the garbage collector swallowed in the last trial
    total = len(setup.candidates.specs) - 1  # the reference is not screened
    setup.events.emit("start", spec.label, index=index, total=total)
    result: TrialResult = setup.run(
        spec,
        steps,
        heldout=setup.heldout,
        eval_fn=setup.eval_fn,
        stop=setup.events.watch(
            time_limit(limit_minutes, setup.clock), spec.label, index=index, total=total
        ),
    )
    failure, stopped = result.record.failure, result.record.stopped
    if stopped is not None:
        screened = ScreenVerdict(
            spec=spec,
            status="stopped",
            reasons=(stopped,),
            steps=result.record.steps_run,
            seconds=result.record.wall_seconds,
        )
    elif failure is not None and not failure.kind.startswith("non_finite"):
        screened = ScreenVerdict(
            spec=spec,
            status="failed",
            reasons=(failure.reason(),),
            steps=result.record.steps_run,
            seconds=result.record.wall_seconds,
        )
    else:
        verdict = references.judge(result, setup.thresholds)
        screened = ScreenVerdict(
            spec=spec,
            status="safe" if verdict.accepted else "unsafe",
            reasons=verdict.reasons,
            drift=verdict.metrics.as_dict(),
            blind_spots=blind_spots(spec) if verdict.accepted else (),
            notes=verdict.notes,
            steps=result.record.steps_run,
            seconds=result.record.wall_seconds,
        )
    status = {"safe": "accepted", "unsafe": "rejected"}.get(screened.status, screened.status)
    outcome = TrialOutcome(spec=spec, status=status, reasons=screened.reasons)  # type: ignore[arg-type]
    setup.events.emit("done", spec.label, index=index, total=total, outcome=outcome)
    return screened, result


@dataclass(frozen=True)
class ScreenRun:
    """What :func:`screen_trials` ran: the fp32 runs, and each mode's verdict beside its trial
    (for benchmarks that judge the same trials again under other thresholds)."""

    references: Fp32Runs
    verdicts: list[ScreenVerdict]
    trials: list[TrialResult]


def screen_setup(
    model: nn.Module,
    loader: Iterable[Any],
    recipe: TrainingRecipe,
    *,
    modes: Sequence[str] | None = None,
    device: str | None = None,
    eval_fn: EvalFn | None = None,
    seed: int = 0,
    thresholds: DriftThresholds | None = None,
    events: EventSink | None = None,
    clock: Callable[[], float] = time.monotonic,
    compile: bool = False,
    keep_fp32: tuple[str, ...] = (),
) -> RunSetup:
    """The run check() screens in: every mode whose numerics run here (``modes``: exactly
    these), no budget; every run compiled with ``compile``; ``keep_fp32`` kept in fp32 by
    every mode that lowers precision."""
    return setup_run(
        model,
        loader,
        recipe,
        modes=modes,
        device=device,
        select=screen_specs,
        eval_fn=eval_fn,
        seed=seed,
        budget_seconds=float("inf"),
        deadline=float("inf"),
        clock=clock,
        thresholds=thresholds,
        events=events or EventSink(None, started=clock(), budget_seconds=0.0, clock=clock),
        compile=compile,
        keep_fp32=keep_fp32,
    )


def screen_trials(setup: RunSetup, steps: int, limit_minutes: float | None = None) -> ScreenRun:
    """Every candidate of ``setup`` trained ``steps`` steps and judged: check()'s work without
    the report. ``limit_minutes`` stops a mode's trial (not fp32's runs) past that time."""
    calibration_run(setup)  # checks the inputs before the long runs
    references = reference_runs(setup, steps, 0, "speed")
    screened = [
        _screen(setup, spec, index, steps, references, limit_minutes)
        for index, spec in enumerate(setup.candidates.specs[1:])
    ]
    return ScreenRun(
        references=references,
        verdicts=[verdict for verdict, _ in screened],
        trials=[trial for _, trial in screened],
    )


def check(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    steps: int = SCREEN_STEPS,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSource | None = None,
    scheduler: SchedulerFactory | None = None,
    total_steps: int | None = None,
    grad_accumulation_steps: int = 1,
    clip_grad_norm: float | None = None,
    train_step: TrainStep | None = None,
    eval_fn: EvalFn | None = None,
    modes: Sequence[str] | None = None,
    keep_fp32: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    thresholds: DriftThresholds | Mapping[str, float] | None = None,
    compile: bool | Literal["auto"] = "auto",
    on_event: Callable[[SearchEvent], None] | None = None,
    progress: bool | None = None,
    max_trial_minutes: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> QualityReport:
    """Run every mode whose numerics run here through the drift gate, whatever its speed.

    Every mode trains ``steps`` optimizer steps of your recipe (as in :func:`autoprec.tune`:
    the peak and floor lrs of your schedule, accumulation, clipping) from the same weights and
    batches as an fp32 reference, and is judged against it and a second fp32 run. FP8 via
    torchao runs emulated where the hardware has no FP8 (quality only; no speed figure is
    taken anywhere here). Arguments as in :func:`autoprec.tune`; ``modes`` picks exactly these
    modes (default: every mode, 8-bit optimizer variants included where bitsandbytes works);
    ``compile`` as in :func:`autoprec.tune` (``"auto"``: every run, fp32 included, trains with
    torch.compile when you pass a compiled model); ``keep_fp32``: module names or patterns
    (``["teacher", "blocks.*.ln_1"]``) every mode that lowers precision keeps in fp32, beside
    what the probe keeps (not tf32: a global matmul setting; the report's notes say so).
    Your model, its gradients and the global RNG states are left as they were. Trials start
    from your model's weights: to judge a mode at the loss your run reaches (FP8's precision
    floor shows only there), pass a model loaded from a checkpoint in the last tenth of your
    run and an optimizer at the lr it ends at (``autoprec check --weights``).
    ``max_trial_minutes`` (default: none) stops a mode's trial as tune's budget would with
    that many minutes (:func:`time_limit`) and reports the mode as stopped, not judged (fp32's
    runs are never stopped); progress shows each trial's pace and time to go either way.

    Returns a :class:`QualityReport`: ``.verdicts`` (safe / unsafe / failed / stopped, every
    reason),
    ``.not_checked`` (modes that cannot run here at all, with reasons), ``.summary()``.
    """
    if max_trial_minutes is not None and (
        isinstance(max_trial_minutes, bool)
        or not isinstance(max_trial_minutes, numbers.Real)  # "1" failed comparing (a hunt)
        or not max_trial_minutes > 0
    ):
        raise ValueError(
            f"max_trial_minutes must be a number of minutes > 0 (or None), not "
            f"{max_trial_minutes!r}."
        )
    device = device_name(device)
    model, use_compile = checked_model(model, device, compile)
    thresholds = resolve_thresholds(thresholds)
    kept = checked_keep_fp32(model, keep_fp32)
    if not isinstance(steps, int) or steps < 4:
        raise ValueError(f"steps must be an int >= 4 (two lr legs of two steps), not {steps!r}.")
    recipe = TrainingRecipe(
        optimizer=optimizer if optimizer is not None else default_optimizer,
        scheduler=scheduler,
        total_steps=total_steps,
        grad_accumulation_steps=grad_accumulation_steps,
        clip_grad_norm=clip_grad_norm,
        loss_fn=loss_fn,
        train_step=train_step,
    )
    start = clock()
    with (
        callers_process_kept("check()"),
        progress_callback(progress, on_event, screen=True) as callback,
    ):
        events = EventSink(callback, started=start, budget_seconds=0.0, clock=clock)
        setup = screen_setup(
            model,
            loader,
            recipe,
            modes=modes,
            device=device,
            eval_fn=eval_fn,
            seed=seed,
            thresholds=thresholds,
            events=events,
            clock=clock,
            compile=use_compile,
            keep_fp32=kept,
        )
        run = screen_trials(setup, steps, max_trial_minutes)
        # inside: it builds the optimizer (and scheduler) again from a factory, which may draw
        # random numbers (found by a hunt: the global RNG moved after check())
        summary = recipe.summary(model)
    reference_verdict = run.references.judge(run.references.reference, setup.thresholds)
    return QualityReport(
        verdicts=tuple(run.verdicts),
        not_checked=setup.candidates.skipped,
        steps=steps,
        device=setup.report.device,
        recipe=summary,
        checks_not_run=(
            *reference_verdict.notes,
            *setup_notes(setup),
            *short_trial_notes(steps, tuned=False),
        ),
        seconds=clock() - start,
    )
