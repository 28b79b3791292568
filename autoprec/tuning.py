"""tune(): probe -> candidates -> search (trial + drift gate) -> choice -> Profile.

The budget is a hard wall: a short fp32 calibration measures the step time, trial lengths are
planned from it, every trial stops when it would pass the deadline, and a trial starts only
with half its expected time and a run's fixed cost left (one the budget then cuts is pruned).
The user's model is never touched: every trial trains a deep copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer

from autoprec._version import __version__
from autoprec._warnings import warn_caller
from autoprec.batching import EvalFn, LossFn, TrainStep, as_plain
from autoprec.drift import Fp32Runs
from autoprec.drift_thresholds import DriftThresholds
from autoprec.fingerprint import (
    StudyFingerprint,
    architecture_digest,
    callable_digest,
    check_study,
    confirm_study,
    load_references,
    optimizer_state_digest,
    references_path,
    save_references,
    tensor_digest,
    trainable_digest,
)
from autoprec.optim import named_groups
from autoprec.outcomes import Objective, TrialOutcome
from autoprec.recipe import (
    OptimizerSource,
    SchedulerFactory,
    TrainingRecipe,
    default_optimizer,
    qualified_name,
)
from autoprec.retiming import CONFIRM_STEPS, confirm_speed
from autoprec.run_inputs import (
    callers_process_kept,
    check_budget,
    checked_keep_fp32,
    checked_model,
    checked_storage,
    device_name,
    resolve_thresholds,
)
from autoprec.run_setup import (
    RunSetup,
    calibrate,
    progress_callback,
    reference_runs,
    setup_notes,
    setup_run,
    short_trial_notes,
)
from autoprec.search import (
    ask_for,
    create_study,
    finished_outcomes,
    make_stop_check,
    optuna_quiet,
    record_outcome,
    record_result,
    search,
    shown_storage,
)
from autoprec.search_events import EventSink, SearchEvent
from autoprec.specs import ModeSpec
from autoprec.trial_failures import first_line
from autoprec.tune_result import TuneResult, budget_report, build_result, trial_outcome

logger = logging.getLogger(__name__)


def _retime(setup: RunSetup, spec: ModeSpec, steps: int, stop: Any) -> Any:
    label = f"re-timing {spec.label}"
    setup.events.emit("phase", label, steps=steps)
    return setup.run(spec, steps, stop=setup.events.watch(stop, label)).record


def _group_names(setup: RunSetup) -> list[list[str]]:
    """The parameter names in each of the recipe's optimizer groups."""
    model, recipe = setup.user_model, setup.recipe
    # the user's optimizer holds the model's own parameters: read as it is, not cloned
    source = recipe.optimizer
    optimizer = source if isinstance(source, Optimizer) else recipe.make_optimizer(model, model)
    return [list(group.names) for group in named_groups(optimizer, model)]


def _hardware(setup: RunSetup) -> str:
    """The device trials ran on; on a CPU its model and torch's thread count too (its speeds
    are its own: a study resumed on another CPU, or under another OMP_NUM_THREADS / taskset,
    reused the first run's speeds)."""
    report, situation = setup.report, setup.situation
    if situation.gpu is None:  # found_device() names torch's version already
        cpu, threads = report.hardware.cpu.model_name, torch.get_num_threads()
        return f"{report.device}: {situation.found_device()}, {cpu}, {threads} threads"
    return f"{report.device}: {situation.found_device()}, torch {report.hardware.torch_version}"


def _fingerprint(setup: RunSetup, objective: Objective, budget_minutes: float) -> StudyFingerprint:
    return StudyFingerprint(
        model=tensor_digest(setup.user_model),
        architecture=architecture_digest(setup.user_model),
        batches=tensor_digest(as_plain([*setup.train, *setup.heldout])),
        trainable=trainable_digest(setup.user_model, _group_names(setup)),
        recipe=setup.recipe.summary(setup.user_model).model_dump(mode="json"),
        objective=objective,
        thresholds=(setup.thresholds or DriftThresholds()).model_dump(mode="json"),
        candidates=tuple(spec.label for spec in setup.candidates.specs),
        keep_fp32=setup.keep_fp32,
        budget_minutes=float(budget_minutes),
        hardware=_hardware(setup),
        seed=setup.seed,
        eval_fn=qualified_name(setup.eval_fn),
        optimizer_state=optimizer_state_digest(setup.recipe.optimizer),
        functions={
            "loss_fn": callable_digest(setup.recipe.loss_fn),
            "train_step": callable_digest(setup.recipe.train_step),
            "eval_fn": callable_digest(setup.eval_fn),
        },
        autoprec_version=__version__,
    )


def tune(
    model: nn.Module,
    loader: Iterable[Any],
    budget_minutes: float = 30,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSource | None = None,
    scheduler: SchedulerFactory | None = None,
    total_steps: int | None = None,
    grad_accumulation_steps: int = 1,
    clip_grad_norm: float | None = None,
    train_step: TrainStep | None = None,
    eval_fn: EvalFn | None = None,
    objective: Objective = "speed",
    modes: Sequence[str] | None = None,
    keep_fp32: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    compile: bool | Literal["auto"] = "auto",
    storage: str | None = None,
    study_name: str | None = None,
    seed: int = 0,
    thresholds: DriftThresholds | Mapping[str, float] | None = None,
    on_event: Callable[[SearchEvent], None] | None = None,
    progress: bool | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> TuneResult:
    """Find the fastest (or leanest) precision mode that passes the drift gate, within budget.

    Every trial runs your training recipe: your optimizer, the learning rates your schedule
    reaches (a leg at its peak and one at its floor), accumulation and clipping.

    Args:
        model: your model; never modified (every trial trains a deep copy in train mode).
        loader: an iterable of batches (tensors, tuples or dicts); up to 64 are read, the last
            few held out for comparing outputs. The global RNG states are restored afterwards.
        budget_minutes: hard wall for the whole search (total wall time <= budget + 5%).
        loss_fn: ``loss_fn(output, target)``; else the model's own scalar / ``.loss`` output.
        optimizer: an optimizer over ``model`` or a factory ``params -> optimizer``
            (default: AdamW with lr 3e-4). Never stepped: trials clone it.
        scheduler: ``factory(optimizer) -> LRScheduler`` (or ``factory(optimizer,
            total_steps=N)``) as your run builds it; needs ``total_steps``.
        total_steps: your real run's number of optimizer steps.
        grad_accumulation_steps: micro-batches per optimizer step.
        clip_grad_norm: max gradient norm, or None.
        train_step: ``train_step(plan, batch) -> loss`` for anything else.
        eval_fn: ``eval_fn(model) -> float`` (lower is better), judged against fp32.
        objective: "speed", "memory" or "balanced".
        modes: restrict the candidates to these canonical mode names.
        keep_fp32: module names or ``fnmatch`` patterns (``["teacher", "blocks.*.ln_1"]``)
            that every mode lowering precision (autocast, pure bf16, FP8) keeps in fp32,
            beside what the probe keeps: state your ``train_step`` updates, a layer you know
            is sensitive. Each must name a module. tf32 has no per-module setting (a note says
            so); the profile carries the list and ``apply()`` keeps it.
        thresholds: the drift gate's bars: a :class:`~autoprec.drift_thresholds.DriftThresholds`
            or a dict of its fields (``{"min_update_fraction": 0.7}``); default: its defaults.
        device: "cpu" or "cuda:N" to tune on (default: where the model is).
        compile: train every run (the fp32 reference too) with ``torch.compile``, as the
            profile's ``apply()`` then does; ``"auto"`` (default): when you passed a compiled
            model (``torch.compile(model)`` or ``model.compile()``). Compilation is timed in
            each run's warm-up, counted in the budget, left out of the speed figures;
            recompiles after warm-up are reported; a mode that fails to compile is a failed
            trial with the compiler's message.
        storage / study_name: an Optuna storage URL to persist (and resume) the study;
            without a name, the storage's study named "autoprec", else its one autoprec
            study, else a new one named "autoprec" (several, none named so: refused).
        on_event: called with a :class:`~autoprec.search_events.SearchEvent` for every phase (fp32
            calibration, reference and noise runs), every trial's start and end, and its step
            count about once a second: ``event.kind``, ``.label``, ``.step`` / ``.steps``,
            ``.elapsed_seconds``, ``.remaining_seconds`` (of the whole budget), ``.best``,
            ``.outcome`` (status, figures, reasons). Exceptions it raises stop the tune.
        progress: show live progress on stderr (default: on in an interactive terminal or a
            notebook, off in logs and pipes).
        seed: the seed of the fp32 reference and of every trial (same weights' draws,
            dropout and batches); the noise runs take ``seed`` + an offset. Part of the
            study's fingerprint.
        clock: the time source of the budget (seconds; tests pass a fake one).

    Example: ``model, _ = examples.tiny_gpt.make_model(); autoprec.tune(model,
    examples.tiny_gpt.make_batches(), budget_minutes=1)`` — see
    examples/README.md for complete runs.
    """
    device = device_name(device)
    model, use_compile = checked_model(model, device, compile)
    check_budget(budget_minutes, objective)
    storage = checked_storage(storage)
    thresholds = resolve_thresholds(thresholds)
    kept = checked_keep_fp32(model, keep_fp32)
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
    budget_seconds = float(budget_minutes) * 60
    with (
        callers_process_kept("tune()"),
        optuna_quiet(),
        progress_callback(progress, on_event) as callback,
    ):
        setup = setup_run(
            model,
            loader,
            recipe,
            modes=modes,
            device=device,
            eval_fn=eval_fn,
            seed=seed,
            budget_seconds=budget_seconds,
            deadline=start + budget_seconds,
            clock=clock,
            thresholds=thresholds,
            events=EventSink(callback, started=start, budget_seconds=budget_seconds, clock=clock),
            compile=use_compile,
            keep_fp32=kept,
        )
        return _search(setup, budget_minutes, objective, storage, study_name, start)


def study_place(study: Any, storage: str | None) -> str:
    """The study as messages name it: its name and its storage, a URL's password as ***."""
    return f"{study.study_name!r} in {shown_storage(storage)}"


def _measured_references(
    setup: RunSetup,
    study: Any,
    storage: str | None,
    fingerprint: StudyFingerprint,
    objective: Objective,
    planned: tuple[int, float],
) -> tuple[Fp32Runs, int, float, bool]:
    """(fp32 runs, trial steps, fp32 step seconds, reused): from the study when it was
    measured under the same fingerprint, else measured now with the ``planned`` (trial steps,
    fp32 step seconds)."""
    budget_minutes = fingerprint.budget_minutes
    where = study_place(study, storage)
    new_run = check_study(study, fingerprint, where)
    cache = references_path(storage, study.study_name)
    attrs = {} if new_run else study.user_attrs  # a stopped run's attributes are not this run's
    stored = None
    if "fp32_step_seconds" in attrs:
        stored = load_references(cache, fingerprint, int(attrs["trial_steps"]))
    if stored is not None:  # a resumed run: the same fp32 runs, measured before
        logger.info("reusing the fp32 reference runs stored in %s", cache)
        steps, step_seconds = int(attrs["trial_steps"]), float(attrs["fp32_step_seconds"])
        # their held-out passes are not repeated: what they found about the inputs still holds
        setup.fresh_batches = setup.fresh_batches or bool(attrs.get("fresh_batches", False))
        return stored, steps, step_seconds, True
    steps, step_seconds = planned
    steps = int(attrs.get("trial_steps", steps))
    study.set_user_attr("trial_steps", steps)
    study.set_user_attr("fp32_step_seconds", step_seconds)
    study.set_user_attr("objective", objective)  # autoprec report reads it
    runs = reference_runs(setup, steps, budget_minutes, objective)
    confirm_study(study, fingerprint, where)  # still ours?
    study.set_user_attr("noise_runs", runs.noise_runs)  # autoprec report counts them
    study.set_user_attr("fresh_batches", setup.fresh_batches)  # for a resumed run
    if cache is not None:
        try:
            save_references(cache, fingerprint, runs, steps)
        except (OSError, RuntimeError) as error:  # a full disk ended the run (a review)
            warn_caller(
                f"Could not store the fp32 reference runs for a resumed run in {cache} "
                f"({type(error).__name__}: {first_line(error)}): "
                "the run goes on, and a resumed one measures them again."
            )
    return runs, steps, step_seconds, False


def _judged_runner(
    setup: RunSetup, fp32_runs: Fp32Runs, steps: int
) -> Callable[[ModeSpec, Any], TrialOutcome]:
    """The search's runner: one trial of a candidate, judged against the fp32 runs when it
    completed or went non-finite (a failure of any other kind is not a verdict on numerics)."""
    device = setup.report.device

    def runner(spec: ModeSpec, stop: Any) -> TrialOutcome:
        result = setup.run(spec, steps, heldout=setup.heldout, eval_fn=setup.eval_fn, stop=stop)
        failure = result.record.failure
        judged = result.record.completed or (
            failure is not None and failure.kind.startswith("non_finite")
        )
        verdict = fp32_runs.judge(result, setup.thresholds) if judged else None
        return trial_outcome(result, verdict, device)

    return runner


def _record_reference(
    study: Any, outcome: TrialOutcome, candidates: list[ModeSpec], fingerprint: str
) -> None:
    """The fp32 reference as the study's first trial (once: a resumed study has it)."""
    label = outcome.label  # fp32, or fp32+compiled
    if label not in finished_outcomes(study, fingerprint):
        trial = ask_for(study, label, [s.label for s in candidates])
        record_outcome(study, trial, outcome, fingerprint)


def _search_candidates(
    setup: RunSetup,
    study: Any,
    objective: Objective,
    fp32_runs: Fp32Runs,
    steps: tuple[int, float],
    reference: TrialOutcome,
    fingerprint: str,
) -> list[TrialOutcome]:
    """Every candidate after the reference, run for ``steps`` (steps, fp32 seconds a step)
    and judged against ``fp32_runs`` within the budget (``search``)."""
    specs = setup.candidates.specs
    return search(
        specs[1:],
        _judged_runner(setup, fp32_runs, steps[0]),
        study=study,
        objective=objective,
        deadline=setup.deadline,
        expected_trial_seconds=steps[0] * steps[1],
        run_overhead_seconds=setup.run_overhead_seconds,
        events=setup.events,
        accepted=[reference],
        choices=[spec.label for spec in specs],
        clock=setup.clock,
        fingerprint=fingerprint,
        tail_seconds=lambda: setup.tail_seconds,  # the slowest tail yet
    )


def _confirmed_speed(
    setup: RunSetup,
    objective: Objective,
    outcomes: list[TrialOutcome],
    reference: TrialOutcome,
    steps: int,
) -> tuple[list[TrialOutcome], TrialOutcome, float | None]:
    """The outcomes with the leaders' speed confirmed by re-timing (``confirm_speed``), and
    the measured speed noise; as they are for the memory objective, which speed does not rank."""
    if objective == "memory":
        return outcomes, reference, None
    budget_only = make_stop_check(None, objective, setup.deadline, setup.clock)
    return confirm_speed(
        outcomes,
        reference,
        setup.deadline,
        setup.clock,
        lambda spec: _retime(setup, spec, min(steps, CONFIRM_STEPS), budget_only),
        objective,
        setup.retime_overhead_seconds,  # a re-timing run calls no eval_fn
    )


def _search(
    setup: RunSetup,
    budget_minutes: float,
    objective: Objective,
    storage: str | None,
    study_name: str | None,
    start: float,
) -> TuneResult:
    clock, candidates = setup.clock, setup.candidates
    # The first fp32 steps check the inputs (batches fit, the loss has gradients) before the
    # study creates any file.
    planned_steps, step_seconds = calibrate(setup, budget_minutes)
    study = create_study(storage, study_name)
    references_started = clock()  # setup, calibration and the study's opening before it
    fingerprint = _fingerprint(setup, objective, budget_minutes)
    measured = _measured_references(
        setup, study, storage, fingerprint, objective, (planned_steps, step_seconds)
    )
    fp32_runs, steps, step_seconds, reused = measured
    # a resumed study's earlier result stops being its last word: an interrupted resume is
    # reported from its trials (the report kept showing the earlier run's choice)
    study.set_user_attr("result", None)
    reference_verdict = fp32_runs.judge(fp32_runs.reference, setup.thresholds)
    reference_outcome = trial_outcome(fp32_runs.reference, reference_verdict, setup.report.device)
    reference_seconds = clock() - references_started  # ~0 when read from the study
    confirm_study(study, fingerprint, study_place(study, storage))  # still ours?
    digest = fingerprint.digest()
    _record_reference(study, reference_outcome, candidates.specs, digest)
    earlier = frozenset(finished_outcomes(study, digest))  # a resumed run's, measured before
    outcomes = _search_candidates(
        setup, study, objective, fp32_runs, (steps, step_seconds), reference_outcome, digest
    )
    outcomes, reference_outcome, speed_noise = _confirmed_speed(
        setup, objective, outcomes, reference_outcome, steps
    )
    budget = budget_report(
        setup,
        outcomes,
        used=clock() - start,
        phases=(references_started - start, reference_seconds),
        steps=(steps, step_seconds),
        noise_runs=fp32_runs.noise_runs,
        reused=reused,
        speed_noise=speed_noise,
        from_study=earlier,
    )
    result = build_result(
        setup,
        objective,
        reference_outcome,
        outcomes,
        budget,
        (
            *reference_verdict.notes,
            *setup_notes(setup),
            *short_trial_notes(steps, tuned=True),
        ),
    )
    record_result(study, result.chosen.label, [result.reference, *result.trials])
    return result
