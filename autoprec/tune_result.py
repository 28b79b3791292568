"""What tune() returns: every trial's outcome, how the budget was spent, the winner's profile.

``trial_outcome`` turns a trial and its verdict into the search's record; ``build_result``
chooses the winner among the outcomes and builds its :class:`~autoprec.profile.Profile`.
"""

from __future__ import annotations

import collections
import math
from typing import Any

from pydantic import BaseModel

from autoprec._models import FROZEN_RECORD
from autoprec.candidates import Skipped
from autoprec.choice import choose, pareto_front, unretimed_margin
from autoprec.drift_blind_spots import blind_spots
from autoprec.outcomes import MemoryKind, Objective, TrialOutcome
from autoprec.profile import Evidence, Profile, TrialFigures, profile_for
from autoprec.recipe import RecipeSummary
from autoprec.run_setup import RunSetup
from autoprec.search import slower_when_cut
from autoprec.specs import ModeSpec
from autoprec.trial_records import TrialResult


class BudgetReport(BaseModel):
    model_config = FROZEN_RECORD

    budget_seconds: float
    used_seconds: float
    calibration_seconds: float
    """Setup (probe, copies), the calibration steps and the study's opening: all before the
    fp32 runs."""
    reference_seconds: float
    """The fp32 reference and noise runs (about 0 when a resumed run read them from its study)."""
    search_seconds: float
    trial_steps: int
    fp32_step_seconds: float
    trials_run: int
    """Every training run of this call: the modes measured, the fp32 reference and its noise
    run(s) unless they came from the study."""
    trials_from_study: int = 0
    """Outcomes a resumed run read from its study (measured by an earlier call), not run."""
    trials_not_run: int
    reference_reused: bool = False
    """The fp32 reference and noise runs came from the study (a resumed run), not re-run."""
    fp32_noise_runs: int = 2
    """2 (another seed and batch order; the weights nudged by 2^-12), or 3 when the model
    draws random numbers (the paired run beside them: same batches, other draws)."""
    speed_noise: float | None = None
    """The largest timing noise the side-by-side re-timing measured (a mode's relative
    difference between its own re-timings); the choice judges each pair of modes on the larger
    of their own two (``TrialOutcome.timing_noise``). None when nothing was re-timed."""


def budget_report(
    setup: RunSetup,
    outcomes: list[TrialOutcome],
    *,
    used: float,
    phases: tuple[float, float],
    steps: tuple[int, float],
    noise_runs: int,
    reused: bool,
    speed_noise: float | None,
    from_study: frozenset[str] = frozenset(),
) -> BudgetReport:
    """Where tune()'s budget went: ``phases`` (calibration, reference seconds) of ``used``,
    the trials' ``steps`` (steps, fp32 seconds a step), the trials run (the reference and its
    ``noise_runs`` included, unless ``reused``) and not run; ``from_study``: the labels a
    resumed run read from its study."""
    calibration_seconds, reference_seconds = phases
    run = [o for o in outcomes if o.seconds > 0]
    earlier = [o for o in run if o.label in from_study]
    return BudgetReport(
        budget_seconds=setup.budget_seconds,
        used_seconds=used,
        calibration_seconds=calibration_seconds,
        reference_seconds=reference_seconds,
        search_seconds=used - calibration_seconds - reference_seconds,
        trial_steps=steps[0],
        fp32_step_seconds=steps[1],
        trials_run=len(run) - len(earlier) + (0 if reused else 1 + noise_runs),
        trials_from_study=len(earlier) + ((1 + noise_runs) if reused else 0),
        trials_not_run=len(outcomes) - len(run),
        reference_reused=reused,
        fp32_noise_runs=noise_runs,
        speed_noise=speed_noise,
    )


class TuneResult(BaseModel):
    """What tune() found: the profile, every trial with its verdict, and how time was spent."""

    model_config = FROZEN_RECORD

    profile: Profile
    objective: Objective
    reference: TrialOutcome
    trials: tuple[TrialOutcome, ...]
    """Every candidate after the reference: accepted / rejected / pruned / failed, reasons."""
    pareto: tuple[TrialOutcome, ...]
    skipped: tuple[Skipped, ...]
    """Modes that cannot run here (never tried), with the probe's reasons."""
    budget: BudgetReport
    recipe: RecipeSummary
    """The training recipe every trial ran (optimizer, lr legs, accumulation, clipping)."""
    checks_not_run: tuple[str, ...] = ()
    """Drift checks this run could not make, and why (e.g. no outputs with train_step)."""
    advice: tuple[str, ...] = ()
    """What to try next, from what the trials showed (e.g. FP8 lost to bf16 running eager)."""

    @property
    def chosen(self) -> ModeSpec:
        return self.profile.spec

    def own_notes(self, outcome: TrialOutcome) -> list[str]:
        """The outcome's notes less those every mode shares (shown once, in
        ``checks_not_run``)."""
        return [note for note in outcome.notes if note not in self.checks_not_run]

    def summary(self) -> str:
        """A plain-text table of every trial and the choice."""
        lines = [f"{'mode':34} {'status':9} {'samples/s':>10} {'memory MiB':>10}  reasons"]
        for outcome in (self.reference, *self.trials):
            speed = (
                f"{outcome.samples_per_second:10.1f}"
                if outcome.samples_per_second
                else (f"{'-':>10}")
            )
            memory = (
                f"{outcome.memory_bytes / 2**20:10.2f}" if outcome.memory_bytes else (f"{'-':>10}")
            )
            mark = "*" if outcome.spec == self.chosen else " "
            lines.append(
                f"{mark}{outcome.label:33} {outcome.status:9} {speed} {memory}  "
                + "; ".join((*outcome.reasons, *self.own_notes(outcome)))
            )
        for skipped in self.skipped:
            lines.append(
                f" {skipped.spec.label:33} {'skipped':9} {'-':>10} {'-':>10}  "
                + "; ".join(skipped.reasons)
            )
        for note in self.checks_not_run:
            lines.append(f"note: {note}")
        for advice in self.advice:
            lines.append(f"advice: {advice}")
        used = self.budget
        lines.append(
            f"chosen: {self.chosen.label} (objective {self.objective}); "
            f"{used.used_seconds:.0f} s of {used.budget_seconds:.0f} s, " + trial_count(used)
        )
        return "\n".join(lines)


def trial_count(budget: BudgetReport) -> str:
    """``N trials of S steps``, and how many a resumed run read from its study."""
    earlier = f" (+{budget.trials_from_study} from the study)" if budget.trials_from_study else ""
    return f"{budget.trials_run} trials of {budget.trial_steps} steps{earlier}"


def trial_outcome(result: TrialResult, verdict: Any, device: str) -> TrialOutcome:
    record = result.record
    if record.failure is not None and not record.failure.kind.startswith("non_finite"):
        status = "failed"  # not a verdict on numerics: an error, OOM, compiler or eval_fn
    elif record.stopped is not None:
        status = "pruned"
    else:
        status = "accepted" if verdict is not None and verdict.accepted else "rejected"
    reasons: tuple[str, ...] = ()
    if status == "pruned":
        reasons = (record.stopped or "",)
    elif verdict is not None:
        reasons = verdict.reasons
    elif record.failure is not None:
        reasons = (record.failure.reason(),)
    on_gpu = device != "cpu"
    # a trial stopped before its first step (the budget, after amp_fp16's loss-scale pass) has
    # no optimizer state yet: its weights alone would read as a lean mode in the table
    stepped = record.steps_run > 0 or record.stopped is None
    state = record.state_bytes.total if record.state_bytes and stepped else None
    activations = None if on_gpu else record.activation_bytes
    memory = record.peak_memory_bytes if on_gpu else state
    kind: MemoryKind = "cuda_peak" if on_gpu else "state_bytes"
    if memory is not None and activations is not None:  # CPU, eager: what a step holds
        memory, kind = memory + activations, "state_and_activations"
    return TrialOutcome(
        spec=record.spec,
        status=status,
        reasons=reasons,
        samples_per_second=record.samples_per_second,
        tokens_per_second=record.tokens_per_second,
        median_step_seconds=record.median_step_seconds,
        memory_bytes=memory,
        memory_kind=kind,
        activation_bytes=activations,
        compiled_graphs=record.compiled_graphs,
        recompiles=record.recompiles,
        seconds=record.wall_seconds,
        steps=record.steps_run,
        drift={} if verdict is None else verdict.metrics.as_dict(),
        gate_notes=() if verdict is None else verdict.notes,
        final_loss=record.losses[-1] if record.losses else None,
        windows=record.windows,
        fp8_layers=record.fp8_layers,
    )


def trial_figures(outcome: TrialOutcome) -> TrialFigures:
    return TrialFigures(
        samples_per_second=outcome.samples_per_second,
        median_step_seconds=outcome.median_step_seconds,
        peak_memory_bytes=outcome.memory_bytes if outcome.memory_kind == "cuda_peak" else None,
        state_bytes=outcome.state_bytes,
        activation_bytes=outcome.activation_bytes,
        final_loss=outcome.final_loss,
    )


def eager_fp8_advice(
    outcomes: list[TrialOutcome], winner: TrialOutcome | None = None
) -> tuple[str, ...]:
    """Advice when torchao's FP8 lost on speed while running eager, pruned as slower or
    accepted and slower than the ``winner``: its float8 casts are separate kernels that
    torch.compile fuses; eager it is slower than bf16 (pytorch/ao#685: one FFN at dim 512,
    eager 3.14 ms vs fp16 0.92 ms, compiled 0.95 ms). An accepted eager FP8 at 524 samples/s
    beside a chosen amp_bf16 at 1417 got no advice (found by a hunt). Transformer Engine's
    FP8 fuses its casts itself: no advice."""

    def lost(o: TrialOutcome) -> bool:
        if o.status == "pruned":
            return any(reason.startswith("slower than") for reason in o.reasons)
        return (
            o.status == "accepted"
            and winner is not None
            and o is not winner
            and (o.samples_per_second or 0.0) < (winner.samples_per_second or 0.0)
        )

    slow = [
        o.label
        for o in outcomes
        if o.spec.mode == "fp8_torchao" and not o.spec.compile and not o.spec.emulate and lost(o)
    ]
    if not slow:
        return ()
    return (
        f"{', '.join(slow)} ran eager and lost on speed: FP8 needs torch.compile to fuse its "
        "casts and beat bf16. Tune again with compile=True (--compile) if your run can "
        "compile.",
    )


def fallback_note(
    winner: TrialOutcome,
    reference: TrialOutcome,
    outcomes: list[TrialOutcome],
    budget: BudgetReport | None = None,
) -> str | None:
    """Why the profile is the fp32 reference when no candidate was accepted: every candidate,
    with what became of it (it said "no candidate passed the drift gate" when all had failed
    before the gate, left out the candidates the budget never ran, and said nothing when one
    was rejected and another cut by the budget)."""
    if winner.spec != reference.spec or not outcomes:
        return None
    if any(o.status == "accepted" for o in outcomes):
        return None  # accepted, and slower than fp32: the table says so
    said = " ".join(
        f"{o.label}: {o.status if o.seconds > 0 else 'not run'} "
        f"({'; '.join(o.reasons) or 'no reason'})."
        for o in outcomes
    )
    note = f"No candidate was accepted ({_tally(outcomes)}); this is the fp32 reference. {said}"
    return note + _budget_advice(outcomes, budget)


def _budget_advice(outcomes: list[TrialOutcome], budget: BudgetReport | None) -> str:
    """What budget would have judged the candidates, when the budget stopped every one of
    them before the gate and none was already slower than the best: the summary of such a run
    read like any other (found by a hunt). Each candidate's run is taken to cost what one fp32
    run did (the reference and noise runs' time over their count)."""
    if budget is None or budget.reference_reused or not outcomes:
        return ""
    for outcome in outcomes:
        reason = outcome.reasons[0] if outcome.reasons else ""
        cut = outcome.status == "pruned" and reason.startswith("budget")
        if not cut or (outcome.seconds > 0 and slower_when_cut(reason) is not None):
            return ""
    per_run = budget.reference_seconds / (1 + budget.fp32_noise_runs)
    before = budget.calibration_seconds + budget.reference_seconds
    needed = before + len(outcomes) * per_run
    return (
        f" The budget ended before any candidate was judged: calibration and the fp32 runs "
        f"took {before:.0f} s of its {budget.budget_seconds:.0f} s, and one run takes about "
        f"{per_run:.0f} s; a budget of {math.ceil(needed / 6) / 10:.1f} minutes or more gives "
        f"each of the {len(outcomes)} candidates a trial (with another study: --study NAME / "
        "study_name=, as a study holds its budget)."
    )


def _tally(outcomes: list[TrialOutcome]) -> str:
    """What became of the candidates, counted: whether quality, speed or the budget kept fp32
    (a demo on a CPU without bf16 kernels, every candidate pruned for speed or budget, read
    "No candidate was accepted" as if the drift gate had refused them all)."""

    def kind(outcome: TrialOutcome) -> str:
        reason = outcome.reasons[0] if outcome.reasons else ""
        if outcome.status == "pruned":
            if reason.startswith("budget"):
                if outcome.seconds <= 0:
                    return "not run for the budget"
                slower = slower_when_cut(reason)
                if slower is None:
                    return "cut by the budget"
                return f"cut by the budget when already slower than {slower}"
            return f"pruned as {reason.split(':')[0]}"  # "slower than fp32", "larger than ..."
        return {"rejected": "rejected by the drift gate", "failed": "failed"}[outcome.status]

    counts = collections.Counter(kind(outcome) for outcome in outcomes)
    tally = [f"{count} {what}" for what, count in counts.items()]
    if "rejected by the drift gate" not in counts:
        tally.append("none rejected by the drift gate")
    return ", ".join(tally)


def build_result(
    setup: RunSetup,
    objective: Objective,
    reference_outcome: TrialOutcome,
    outcomes: list[TrialOutcome],
    budget: BudgetReport,
    checks_not_run: tuple[str, ...],
) -> TuneResult:
    margin, unretimed = unretimed_margin(objective, reference_outcome, outcomes)
    checks_not_run = (*checks_not_run, *unretimed)
    # each re-timed mode's own noise; without re-timing, the measured trial-to-trial margin
    winner = choose(outcomes, reference_outcome, objective, margin)
    note = fallback_note(winner, reference_outcome, outcomes, budget)
    evidence = Evidence(
        trial_steps=budget.trial_steps,
        trial_count=budget.trials_run + budget.trials_from_study,  # all it rests on
        trials_from_study=budget.trials_from_study,
        budget_seconds=budget.budget_seconds,
        budget_used_seconds=budget.used_seconds,
        reference=trial_figures(reference_outcome),
        chosen=trial_figures(winner),
        drift=winner.drift,
        fp8_layers=winner.fp8_layers,
        blind_spots=blind_spots(winner.spec),
        notes=tuple(note for note in winner.notes if note not in checks_not_run),
    )
    recipe = setup.recipe.summary(setup.user_model)
    profile = profile_for(
        winner.spec,
        model_layers=setup.report.layers,
        hardware=setup.report.hardware,
        device=setup.report.device,
        evidence=evidence,
        recipe=recipe,
        note=note,
    )
    return TuneResult(
        profile=profile,
        objective=objective,
        reference=reference_outcome,
        trials=tuple(outcomes),
        pareto=tuple(pareto_front([reference_outcome, *outcomes])),
        skipped=setup.candidates.skipped,
        budget=budget,
        recipe=recipe,
        checks_not_run=checks_not_run,
        advice=eager_fp8_advice(outcomes, winner if objective == "speed" else None),
    )
