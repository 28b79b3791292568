"""What one tune() or check() run shares: its batches split (run_inputs checks the inputs
themselves), its model probed and candidates chosen, the fp32 calibration that plans trial
lengths, and the fp32 reference and noise runs every verdict is judged against."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from autoprec._wording import first_names
from autoprec.batching import (
    EvalFn,
    FreshBatches,
    LossFn,
    WatchedBatches,
    first_model_call,
    fresh_copy,
    same_batch,
    to_device,
)
from autoprec.candidates import (
    EIGHT_BIT_SUFFIX,
    CandidateList,
    Skipped,
    candidate_specs,
    with_user_keep_fp32,
)
from autoprec.drift import Fp32Runs
from autoprec.drift_thresholds import DriftThresholds
from autoprec.eligibility import Situation, model_device, model_devices
from autoprec.errors import BatchError, BudgetTooSmallError, LossError, UnsupportedModeError
from autoprec.hook_copies import unmapped_hooks
from autoprec.model_copies import UserModelWatch, deep_copy
from autoprec.modes import mode_for
from autoprec.outcomes import Objective
from autoprec.outside_state import OutsideStateWatch, same_digest
from autoprec.plan import build_plan
from autoprec.probing import ProbeReport, probe
from autoprec.recipe import (
    LrPoint,
    TrainingRecipe,
    default_optimizer,
    refuse_wrong_arity,
    scheduled_lr_note,
)
from autoprec.run_inputs import MAX_BATCHES, check_seed, collect_batches, keeps_every_trainable
from autoprec.search import make_stop_check
from autoprec.search_events import EventSink, SearchEvent
from autoprec.specs import ModeSpec
from autoprec.trial import run_trial
from autoprec.trial_records import StepWindow, TrialResult

logger = logging.getLogger(__name__)

HELDOUT_BATCHES = 4
"""Batches kept out of training to compare outputs and losses (fewer when the loader is short)."""
MIN_TRIAL_STEPS, MAX_TRIAL_STEPS = 20, 300
WARMUP_STEPS = 2
CALIBRATION_STEPS = 5
BUDGET_RESERVE = 0.08
"""Share of the budget kept back for what is not a trial step (copies, held-out passes)."""


def _example_input(batch: Any, loss_fn: LossFn | None) -> Any:
    """What training calls the model with (``forward_and_loss``): with ``loss_fn``, a tuple
    batch's inputs before its target as positional arguments (``((a, b), y)`` calls
    ``model((a, b))``), else the batch as it is."""
    if loss_fn is not None and isinstance(batch, tuple | list) and len(batch) >= 2:
        return tuple(batch[:-1])
    return batch


def _scanned_copy(
    trial_model: nn.Module, batch: Any, recipe: TrainingRecipe
) -> tuple[nn.Module, Any]:
    """(a copy of the model for the probe's scan, the input training calls the model with:
    None when unknown). The scan's forward never runs on the model the trials copy (your own
    where no device is given): a forward's side effects (a counter, a cache, a lazy module's
    first shapes) stay out of it. Under ``train_step`` the input is what it passes
    ``plan.model`` first, from one run of it on the scan's copy (which
    also refuses an autocast of its own: ``batching.first_model_call``)."""
    scanned = deep_copy(trial_model)
    batch = to_device(fresh_copy(batch), model_device(trial_model))  # the scan may change it
    if recipe.train_step is None:
        return scanned, _example_input(batch, recipe.loss_fn)
    try:
        never_stepped = torch.optim.SGD(scanned.parameters(), lr=0.0)
        plan = build_plan(ModeSpec(mode="fp32"), scanned, never_stepped)
    except Exception:  # the scan runs without a forward; the calibration reports the error
        logger.debug("no fp32 plan for the scan's train_step call", exc_info=True)
        return scanned, None
    return scanned, first_model_call(recipe.train_step, plan, batch)


def _reading_within_budget(shared: dict[str, Any]) -> Callable[[int], None] | None:
    """A check, after each batch read, that the budget's end has not passed: a loader of 2 s
    a batch read 16 batches and tune() then refused the budget 33 s into a 15 s one (found by
    a hunt). None without a deadline (check())."""
    deadline, clock = shared.get("deadline"), shared.get("clock")
    if deadline is None or clock is None or not math.isfinite(deadline):
        return None
    started = clock()
    minutes = shared.get("budget_seconds", 0.0) / 60

    def check(count: int) -> None:
        now = clock()
        if now < deadline:
            return
        per_batch = (now - started) / count
        raise BudgetTooSmallError(
            round(minutes, 4),
            f"is too small to read the loader's batches: {count} took {now - started:.3g} s "
            f"and the budget ended. autoprec reads up to {MAX_BATCHES} batches once, before "
            f"any run (at this pace {per_batch * MAX_BATCHES:.3g} s): give a budget well above "
            "that, or a loader that reads faster.",
        )

    return check


def _warn_trained_heldout(train: list[Any], heldout: list[Any]) -> None:
    """Say when held-out batches (the last ones read) are training batches too: a loader
    cycling over fewer batches than autoprec reads (``while True: yield from loader``) made
    every held-out comparison one on data the runs trained on, without a word (found by a
    hunt)."""
    try:
        repeated = sum(any(same_batch(batch, seen) for seen in train) for batch in heldout)
    except Exception:  # a layout whose values cannot be compared (sparse): nothing said
        logger.debug("held-out batches not compared with the training ones", exc_info=True)
        return
    if repeated:
        logger.warning(
            "%d of the %d held-out batches (the last ones the loader gave) are training "
            "batches too: the loader repeats its batches, and the held-out loss and output "
            "comparisons read data every run trained on. Give a loader of %d or more distinct "
            "batches (autoprec reads up to %d).",
            repeated,
            len(heldout),
            2 * HELDOUT_BATCHES,
            MAX_BATCHES,
        )


def _warn_accumulating_repeats(accumulation: int, held: int) -> None:
    """An optimizer step of more micro-batches than the runs train on sums some batch twice:
    every step then follows nearly the same gradient, with less of the noise the real run's
    distinct batches carry, and each step takes ``accumulation`` forward passes (found by a
    hunt: 10**9 ran on without a word)."""
    if accumulation > held:
        logger.warning(
            "Each optimizer step accumulates %d micro-batches, and the runs train on the %d "
            "batches the loader gave (autoprec reads up to %d, keeping the last for held-out "
            "comparisons): every step sums the same batches again, nearly the same gradient "
            "each time, where your run's distinct batches differ. Give a loader of more "
            "batches, or pass the accumulation of a shorter run.",
            accumulation,
            held,
            MAX_BATCHES,
        )


def _scanned_copy_kept_apart(
    model: nn.Module, trial_model: nn.Module, batch: Any, recipe: TrainingRecipe
) -> tuple[nn.Module, Any]:
    """:func:`_scanned_copy`, with the user's ``model`` put back as it was when the scan's
    ``train_step`` call ran it: a ``train_step`` closing over the user's model (not
    ``plan.model``) ran its forward there, moving BatchNorm's statistics before the
    calibration's watch was taken, whose refusal then said they were put back (found by a
    hunt). The calibration refuses that ``train_step``."""
    if recipe.train_step is None:
        return _scanned_copy(trial_model, batch, recipe)
    # the scan's run has gradients (a gradient penalty's autograd.grad): one stepping your
    # optimizer on your model stepped it here too, and that optimizer is put back as well
    optimizer = recipe.optimizer if isinstance(recipe.optimizer, torch.optim.Optimizer) else None
    watch = UserModelWatch(model, optimizer, copy_weights=True)
    outside = OutsideStateWatch(recipe.train_step, model)  # an EMA teacher's update ran (a review)
    try:
        return _scanned_copy(trial_model, batch, recipe)
    finally:
        watch.restore()  # copies back only what changed
        outside.restore()


_BOTH_GRADIENTS = (
    "pass one that takes both (optimizer=lambda p: torch.optim.SGD(p, lr=...), or Adagrad), "
    "or build the embedding with sparse=False."
)


def _shape_of(value: Any) -> str:
    """A batch element as a message shows it: a tensor by its shape, a tuple by its parts."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_shape_of(part) for part in value) + ")"
    return type(value).__name__


def _reference_hint(message: str, setup: RunSetup) -> str:
    """What to do about a failing fp32 reference, from what failed (the trial's one-line
    message: exception type and first line)."""
    recipe, batch = setup.recipe, setup.train[0]
    own_backward = ("backward through the graph a second time", "does not require grad")
    if recipe.train_step is not None and any(said in message for said in own_backward):
        # a train_step written like the apply() loop: it ran backward (or plan.step) itself,
        # or returned the loss detached after doing so (found by a hunt: "check that the
        # loader's batches fit the model" / "does not depend on any trainable parameter")
        return (
            "If your train_step runs loss.backward(), plan.step(loss) or an optimizer step "
            "itself, leave them out: it must only compute the loss (under plan.autocast() "
            "where it calls plan.model) and return it, and autoprec runs the backward pass and "
            "the step. Otherwise the loss does not flow from plan.model's output."
        )
    if "does not require grad" in message or "does not have a grad_fn" in message:
        return (
            "The loss has no gradient: it does not depend on any trainable parameter (a "
            "detached output, torch.no_grad() in forward, or a loss of the targets alone). "
            "Make the loss flow from the model's output."
        )
    if any(said in message for said in ("copy.deepcopy", "not a torch.optim", "not a scalar")):
        return ""  # the message itself says what to do
    if "dense gradients" in message:  # SparseAdam beside dense layers (a review)
        return (
            "SparseAdam takes only sparse gradients, and the model's other layers give dense "
            f"ones. autoprec runs one optimizer: {_BOTH_GRADIENTS}"
        )
    if "sparse gradients" in message:  # the loader was blamed (found by a hunt)
        which = (
            "autoprec's default AdamW (no optimizer was passed)"
            if recipe.optimizer is default_optimizer
            else "your optimizer"
        )
        return (
            f"A layer gives sparse gradients (nn.Embedding(sparse=True)) and {which} does not "
            "take them. autoprec runs one optimizer, and SparseAdam takes only sparse "
            f"gradients: {_BOTH_GRADIENTS}"
        )
    positional = "positional argument" in message or "unexpected keyword argument" in message
    if positional and recipe.loss_fn is None and recipe.train_step is None:
        if isinstance(batch, tuple | list):
            return (
                f"Without a loss function autoprec called model(*batch) with all "
                f"{len(batch)} elements of the batch. If the last one is the target, pass "
                "loss_fn(output, target) (CLI: --loss module:fn); for anything else pass "
                "train_step(plan, batch) -> loss."
            )
        if isinstance(batch, Mapping):
            return (
                f"Without a loss function autoprec called model(**batch) with keys "
                f"{sorted(batch)}. Pass loss_fn(output, batch) (CLI: --loss module:fn) or "
                "train_step(plan, batch) -> loss."
            )
    nested = (
        isinstance(batch, tuple | list)
        and len(batch) >= 2
        and any(isinstance(value, tuple | list) for value in batch[:-1])
    )  # a flat batch's missing argument may be loss_fn's own, or a mask (a review)
    missing = "positional argument" in message
    if missing and nested and recipe.loss_fn is not None and recipe.train_step is None:
        # ((src, tgt_in), labels) called model((src, tgt_in)): the error named only the
        # missing argument (found by a hunt, on a seq2seq model)
        inputs = ", ".join(_shape_of(value) for value in batch[:-1])
        return (
            f"With loss_fn, a tuple batch is (*inputs, target): autoprec called "
            f"model({inputs}) with all but the last of its {len(batch)} elements, and "
            "passed the last to loss_fn as the target. Give the batch as flat "
            "(input, ..., target) tuples, or pass train_step(plan, batch) -> loss."
        )
    return (
        "Check that the loader's batches fit the model (and loss_fn / train_step): nothing "
        "can be compared without it."
    )


FRESH_BATCHES_NOTE = (
    "the model (or loss_fn / train_step) changes its input batches in place: every run read a "
    "fresh copy of each batch, copied inside the timed step as a loader's fresh batch is, and "
    "your batches were left as they were"
)


TF32_KEEP_NOTE = (
    "keep_fp32 does not apply to tf32 (TF32 is one global matmul setting, not a per-module "
    "one): its trial ran every layer's matmuls in TF32"
)


SHORT_TRIAL_STEPS = 40
"""Trials shorter than this get a note. On the ground truth (docs/ground-truth.md, "The gate at
the trial lengths tune() uses") the weight-movement check rejected bf16_kahan on the digits
autoencoder in 20- and 30-step trials (68-69% of fp32's movement in 10- and 15-step legs; its
long runs end +1.0% against a line at +5.4%) and passed it from 40 steps; at 86 and 200 steps
the six cached tasks' 68 verdicts agree. The cause there: torch-optimi's Adam corrects its first
moment's bias otherwise than torch's when β1 changes (OneCycleLR), and the trial's jump from the
peak leg's β1 to the floor leg's, early in the trial, made torch's step 1.46x torch-optimi's.
The note, not a longer minimum: the shortest trials are what a small budget buys, and the bar
a short leg should meet is not measured yet."""


def short_trial_notes(steps: int, *, tuned: bool) -> tuple[str, ...]:
    """The note for trials under ``SHORT_TRIAL_STEPS`` steps, or none; its remedy is a larger
    budget for ``tune()`` (``tuned``), more steps for ``check()``."""
    if steps >= SHORT_TRIAL_STEPS:
        return ()
    remedy = (
        f"A budget of at least {SHORT_TRIAL_STEPS / steps:.1f}x this one gives "
        f"{SHORT_TRIAL_STEPS}-step trials."
        if tuned
        else f"Check with steps={SHORT_TRIAL_STEPS} or more (--steps {SHORT_TRIAL_STEPS})."
    )
    return (
        f"trials ran {steps} steps: under {SHORT_TRIAL_STEPS}, the drift gate's weight-movement "
        "check has rejected a mode that long runs found fine (bf16_kahan on autoprec's "
        f"ground-truth autoencoder, at 20 and 30 steps). {remedy}",
    )


def setup_notes(setup: RunSetup) -> tuple[str, ...]:
    """What the run did differently from a plain trial, for the result's notes."""
    notes = (FRESH_BATCHES_NOTE,) if setup.fresh_batches else ()
    if setup.keep_fp32 and any(spec.mode == "tf32" for spec in setup.candidates.specs):
        notes += (TF32_KEEP_NOTE,)
    unmapped = unmapped_hooks(setup.user_model)
    if unmapped:
        notes += (
            f"gradient hooks not run in trials: those on {first_names(unmapped, 4)} read your "
            "model's parameters, buffers or modules through a module-level name, a list, "
            "tuple, set or dict, or an object outside the model, which a trial's copy cannot "
            "map to its own; every run trained without them",
        )
    return notes


EVAL_FN_HINT = (
    "eval_fn runs on every trained copy after its training steps, in eval mode, under "
    "torch.no_grad() and the mode's autocast, and must return one finite number (lower is "
    "better)."
)


_INPUT_ERRORS: dict[str, type[ValueError]] = {"LossError": LossError, "BatchError": BatchError}
"""autoprec's refusals of the user's loss or batches, raised as themselves (the README names
``autoprec.LossError``; a plain ValueError said "raised by autoprec's own code: report it")."""


def reference_failed(
    result: TrialResult, setup: RunSetup, label: str = "fp32 reference"
) -> ValueError:
    """The refusal of a failed fp32 run, named by ``label`` (the reference, or a noise run on
    another seed and batch order: a noise run's divergence read "The fp32 reference failed",
    found by a hunt); a divergence is said to be fp32's own, not the batches'."""
    failure = result.record.failure
    assert failure is not None
    where = "" if failure.step is None else f" at step {failure.step}"
    name, _, text = failure.message.partition(": ")
    if name in _INPUT_ERRORS and text:
        return _INPUT_ERRORS[name](f"The {label} failed{where}: {text}")
    if failure.kind.startswith("non_finite") and failure.step:  # no update before step 0
        return ValueError(
            f"The {label} failed{where}: {failure.located()}. fp32 training itself diverged "
            f"here{_how_it_differs(label)}, or a batch or the loss holds a non-finite "
            "value: no mode can be judged against it. If the loss was finite until then, your "
            "recipe is unstable at this learning rate: lower the lr, add warm-up (scheduler=) "
            "or clip gradients (clip_grad_norm=), as your real run would need to, and run "
            "again."
        )
    if failure.kind == "eval_failed":
        hint = EVAL_FN_HINT
    elif failure.kind == "out_of_memory":  # read as a shape problem (found by a hunt)
        hint = (
            "fp32, the reference every mode is judged against, does not fit here: tune with "
            "a smaller batch (trials measure speed per sample), or free the device's memory."
        )
    elif failure.raised_by_autoprec:
        hint = (
            "The error was raised by autoprec's own code, not by your model, batches or loss: "
            "please report it with this message."
        )
    else:
        hint = _reference_hint(failure.message, setup)
    return ValueError(f"The {label} failed{where}: {failure.located()}. {hint}".rstrip())


def _how_it_differs(label: str) -> str:
    """How the fp32 run named ``label`` differs from the reference, for its divergence's
    refusal (a review: the paired run was said to run on another batch order)."""
    differs = {
        NOISE_RUN.label: "on another seed and batch order",
        PAIRED_RUN.label: "with other random draws on the same batches",
        NUDGED_RUN.label: "from weights nudged 2^-12, on the reference's seed and batches",
    }
    return f" {differs[label]} (the reference itself trained)" if label in differs else ""


def _reference_still(result: TrialResult) -> ValueError:
    lrs = "; ".join(point.describe() for point in result.record.lr_points)
    return ValueError(
        f"The fp32 reference did not change any weight in {result.record.steps_run} steps "
        f"({lrs}): the loss does not reach the trainable parameters (no gradients), or the "
        "optimizer does not move them. Nothing can be judged against a run that does not train."
    )


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


RUNNING_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
"""Buffers a normalisation layer updates in training mode: changed alone, by a frozen network
left in train mode (a review: the refusal spoke of an EMA teacher and never of ``.eval()``)."""


def _changed_outside_the_model(names: list[str], during: str) -> ValueError:
    changed = f"Your train_step changes {_names(names)}, outside the model you hand autoprec"
    harm = (
        "every run would start from where the last one left it, and your object would come "
        "back changed"
    )
    if all(name.rsplit(".", 1)[-1] in RUNNING_STATISTICS for name in names):
        return ValueError(
            f"{changed}: running statistics of a network it calls in training mode (a frozen "
            f"feature extractor or loss network, whose BatchNorm updates them each call): "
            f"{harm}. Call .eval() on that network before tune()/check(), or make it a "
            "submodule of the model. It was put back as it was."
        )
    return ValueError(
        f"{changed} (an EMA teacher, a target network or an EMA's shadow weights it reaches, "
        f"found: it changed during {during}): {harm}. Make it a submodule of "
        "the model and update plan.model's, so each run trains its own copy (keep_fp32="
        "['teacher'] keeps such a module in fp32); an EMA your loss does not read belongs in "
        "your own loop, after plan.step(), not in the train_step. It was put back as it was."
    )


def _trained_the_users_model(
    names: list[str], moved: list[str], stepped: list[str], setup: RunSetup
) -> ValueError:
    source = "train_step" if setup.recipe.train_step is not None else "loss_fn"
    use = "plan.model" if source == "train_step" else "the output it is given"
    if stepped and source == "loss_fn":  # its forwards moved buffers (BatchNorm statistics)
        aftermath = (
            f"Its forward passes also changed {len(stepped)} of the model's buffers "
            f"({_names(stepped)}): they were put back as they were, with the gradients."
        )
    elif stepped:
        aftermath = (
            f"It also changed {len(stepped)} of the model's weights and buffers "
            f"({_names(stepped)}): they were put back as they were, with the gradients and the "
            "state of the optimizer passed to autoprec; an optimizer of your own that it "
            "stepped keeps what those steps gave it."
        )
    elif "optimizer state" in moved:
        aftermath = "The optimizer passed to autoprec was put back as it was."
    else:
        aftermath = "Your model's gradients were put back as they were."
    what = (
        f"put gradients on your own model's parameters ({_names(names)})"
        if names
        else "changed your own model without leaving a gradient on it"
    )
    return ValueError(
        f"Training the fp32 reference {what}: your {source} calls the model it closes over, "
        f"not the copy each run trains, so no run would measure its mode. Use {use} in "
        f"{source}. {aftermath}"
    )


def _refuse_unscored_heldout(result: TrialResult, setup: RunSetup, label: str) -> None:
    """An fp32 run's held-out loss that is not finite: nothing can be compared on it."""
    losses = result.record.heldout_losses
    bad = [index for index, loss in enumerate(losses) if not math.isfinite(loss)]
    if not bad:
        return
    found = ", ".join(
        f"batch {len(setup.train) + index} of the loader's {len(setup.train) + len(losses)}: "
        f"{losses[index]}"
        for index in bad
    )
    raise ValueError(
        f"The {label}'s held-out loss is not finite ({found}; the last {len(losses)} batches "
        "read are held out, counted from 0). A batch the loss cannot score (every target "
        "ignored, all padding) or one that overflows in fp32 leaves nothing to compare a mode "
        "with. Drop such batches from the loader you pass (autoprec reads its first "
        f"{MAX_BATCHES}), or make the loss finite on them."
    )


@dataclass
class RunSetup:
    """What every stage of one tune() run shares."""

    user_model: nn.Module
    trial_model: nn.Module
    recipe: TrainingRecipe
    train: list[Any]
    heldout: list[Any]
    report: ProbeReport
    situation: Situation
    candidates: CandidateList
    lr_points: tuple[LrPoint, ...]
    """The learning rates of the trial legs, read once from the recipe's schedule."""
    eval_fn: EvalFn | None
    seed: int
    budget_seconds: float
    deadline: float
    clock: Callable[[], float]
    thresholds: DriftThresholds | None
    events: EventSink
    compile: bool = False
    """Every run (the fp32 reference and noise runs included) trains compiled."""
    keep_fp32: tuple[str, ...] = ()
    """Your module-name patterns every candidate that lowers precision keeps in fp32."""
    fresh_batches: bool = False
    """The model (or loss / train_step) changed its input batch in place in calibration:
    every run then reads a fresh copy of each batch (:class:`FreshBatches`)."""
    run_overhead_seconds: float = 0.0
    """What a run costs beyond its steps (copying, converting, warming up), as calibration
    measured it: the re-timing's budget check counts it once per re-timing run."""
    retime_overhead_seconds: float = 0.0
    """``run_overhead_seconds`` without calibration's ``eval_fn`` time: what a re-timing run,
    which calls no ``eval_fn``, costs beyond its steps (found by a hunt: a 2 s ``eval_fn``
    charged twice skipped the re-timing with 7 s left)."""
    tail_seconds: float = 0.0
    """What a run spends after its last step (held-out pass, ``eval_fn``), the slowest of the
    runs so far, calibration's first: the budget's stop checks reserve it."""
    outside: OutsideStateWatch | None = None
    """The calibration's watch of what the ``train_step`` reaches outside the model, kept with
    its one host copy for the runs after it (None before calibration)."""

    @property
    def reference_spec(self) -> ModeSpec:
        """fp32, compiled when the candidates are."""
        return ModeSpec(mode="fp32", compile=self.compile)

    def run(
        self,
        spec: ModeSpec,
        steps: int,
        *,
        batches: Sequence[Any] | None = None,
        watch_outside: bool = True,
        **options: Any,
    ) -> TrialResult:
        """One run of ``spec`` (a trial, or an fp32 run) on the trial model. What the
        ``train_step`` reaches outside the model is watched through every run (the
        calibration's host copy, compared by on-device sums), put back and refused where a run
        changed it, and the numbers it counts with are put back after every run
        (``watch_outside=False``: the caller watches). The calibration's 5 steps alone found a
        target network copied every 5 steps, not one copied every 10, which came back changed
        and every run started from the last's; a step counter ran on from run to run (both
        found by hunts)."""
        outside = self.outside if watch_outside else None
        if outside is None and watch_outside:
            outside = OutsideStateWatch(self.recipe.train_step, self.user_model)
        before = outside.digest() if outside is not None and outside.tensors else None
        if outside is not None:
            options.setdefault("carried", outside.carried)
        try:
            result = self._run(spec, steps, batches, options)
        finally:  # a step counter it reaches is put back every run (a hunt)
            changed: list[str] = []
            if (
                before is not None
                and outside is not None
                and not same_digest(before, outside.digest())
            ):
                changed = outside.restore()
            if outside is not None:
                outside.restore_numbers()
        if changed:
            raise _changed_outside_the_model(changed, f"the {spec.label} run of {steps} steps")
        return result

    def _run(
        self, spec: ModeSpec, steps: int, batches: Sequence[Any] | None, options: dict[str, Any]
    ) -> TrialResult:
        options.setdefault("seed", self.seed)
        batches = self.train if batches is None else batches
        if self.fresh_batches:
            batches = FreshBatches(batches)
            if options.get("heldout"):
                options["heldout"] = FreshBatches(options["heldout"])
        result = run_trial(
            spec,
            self.trial_model,
            batches,
            recipe=self.recipe,
            steps=steps,
            lr_points=self.lr_points,
            warmup_steps=WARMUP_STEPS,
            situation=self.situation,
            **options,
        )
        # the slowest tail yet is what later runs reserve: an eval_fn slower after its first
        # call (a cache warmed, a data set loaded) had carried runs past the budget
        self.tail_seconds = max(self.tail_seconds, result.tail_seconds)
        return result


def _forward_autocast_refusal(found: str, model: nn.Module) -> ValueError:
    """A model whose forward enters an autocast of its own (``LayerMix.forward_autocast``);
    one accelerate's ``prepare`` wrapped in its autocast is told to pass the unwrapped model
    (a review: it was told to edit a forward it never wrote)."""
    fix = (
        "Take that torch.autocast out of forward (an autocast block with enabled=False, "
        "keeping a part in fp32, is fine)"
    )
    if "_original_forward" in vars(model):
        fix = (
            "It is accelerate's: Accelerator(mixed_precision=...).prepare(model) wrapped the "
            "forward in its autocast. Pass accelerator.unwrap_model(model), or tune before "
            "prepare()"
        )
    return ValueError(
        f"The model's forward enters an autocast of its own ({found}, found by the scan's "
        "fp32 forward): it sets the dtype of what runs under it in every run, so the fp32 "
        "reference and every trial would compute that in its dtype and each mode would be "
        f"compared with it, not with fp32. {fix}: each mode's plan.autocast() sets the "
        "precision, in trials and in your loop after apply()."
    )


def refuse_unrunnable(candidates: CandidateList, modes: Sequence[str] | None) -> None:
    """Modes asked for by name that cannot run here are an error, never quietly dropped."""
    if modes is None or not candidates.skipped:
        return

    def name(spec: ModeSpec) -> str:
        return spec.mode + (EIGHT_BIT_SUFFIX if spec.optimizer_bits == 8 else "")

    lines = "; ".join(
        f"{name(skipped.spec)}: {', '.join(skipped.reasons).rstrip('.') or 'not eligible'}"
        for skipped in candidates.skipped
    )
    names = ", ".join(name(skipped.spec) for skipped in candidates.skipped)
    reasons = [reason for skipped in candidates.skipped for reason in skipped.reasons]
    fix = (
        "or change the optimizer as the reason says"
        if reasons and all(reason.startswith(OPTIMIZER_REASON) for reason in reasons)
        else "or run them where they can (autoprec probe shows what this machine and model allow)"
    )
    raise UnsupportedModeError(
        f"Requested mode(s) cannot run on this model here: {lines}. Leave {names} out of the "
        f"modes, {fix}.{_screen_here(candidates)}",
        tuple(reasons),
    )


def _screen_here(candidates: CandidateList) -> str:
    """Where torchao's FP8 was refused for the hardware alone, that ``check`` screens its
    quality here, emulated (a hunt: tune's refusal named only "run them where they can")."""
    fp8 = [s for s in candidates.skipped if s.spec.mode == "fp8_torchao"]
    if not fp8 or not all("compute capability" in r for s in fp8 for r in s.reasons):
        return ""
    return (
        " To ask whether FP8 would hurt the model before renting such a GPU, autoprec.check() "
        "(`autoprec check --modes fp8_torchao`) screens its quality here, emulated."
    )


CandidateSelector = Callable[[ProbeReport, Situation, "list[str] | None"], CandidateList]


def _tune_candidates(
    report: ProbeReport, situation: Situation, modes: Sequence[str] | None
) -> CandidateList:
    return candidate_specs(report, modes)


OPTIMIZER_REASON = "with your optimizer: "
"""How a skip reason about the recipe's optimizer (not the machine) begins."""


def _without_untranslatable(
    candidates: CandidateList, optimizer: torch.optim.Optimizer
) -> CandidateList:
    """Move the candidates that cannot rebuild the recipe's optimizer (8-bit states for SGD
    without momentum, an optimizer autoprec cannot translate) to the skipped, with the reason:
    they would only fail as trials."""
    kept, skipped = [], list(candidates.skipped)
    for spec in candidates.specs:
        problem = mode_for(spec).optimizer_problem(optimizer)
        if problem is None:
            kept.append(spec)
        else:
            skipped.append(Skipped(spec=spec, reasons=(f"{OPTIMIZER_REASON}{problem}",)))
    return candidates.model_copy(update={"specs": tuple(kept), "skipped": tuple(skipped)})


def _without_lowering_nothing(candidates: CandidateList, model: nn.Module) -> CandidateList:
    """Move the pure-bf16 candidates whose keep-list (the probe's norms and embeddings, and
    the user's ``keep_fp32``) holds every parameter, frozen ones too (a frozen Linear left out
    computes in bf16), to the skipped, with the reason: on an embedding-only model (matrix
    factorisation, a recommender of lookups) they put nothing in bf16, and were called safe
    and chosen by tune() for timing noise on the same fp32 work (found by a hunt: "3.2x
    faster"). The 8-bit states' like case is the candidates' (``no_8bit_state``)."""
    kept, skipped = [], list(candidates.skipped)
    for spec in candidates.specs:
        if not spec.mode.startswith("bf16") or not keeps_every_trainable(
            model, spec.keep_fp32, frozen_too=True
        ):
            kept.append(spec)
            continue
        same = "fp32+8bit-optim" if spec.optimizer_bits == 8 else "fp32"
        kept_names = first_names(spec.keep_fp32)
        reason = (
            f"it would put nothing in bf16: the modules it keeps in fp32 ({kept_names}) hold "
            f"every parameter of {type(model).__name__} (pure bf16 keeps norms and "
            f"embeddings in fp32, and your keep_fp32), so it would train as {same} under "
            "another name"
        )
        skipped.append(Skipped(spec=spec, reasons=(reason,)))
    return candidates.model_copy(update={"specs": tuple(kept), "skipped": tuple(skipped)})


def _already_on(model: nn.Module, device: str | int | None) -> bool:
    """Whether the trials can run on ``model`` where it is: no ``device=``, or the one it is on.
    ``device="cpu"`` for a model on the CPU held a second copy through the whole run (found by
    a hunt; on a GPU, ``--device cuda:0`` for a model there, two on the GPU)."""
    if device is None:
        return True
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    name = "cpu" if target.type == "cpu" else f"cuda:{target.index}"
    return model_devices(model) == (name,)


def setup_run(
    model: nn.Module,
    loader: Iterable[Any],
    recipe: TrainingRecipe,
    *,
    modes: Sequence[str] | None,
    device: str | None,
    select: CandidateSelector | None = None,
    **shared: Any,
) -> RunSetup:
    """Read the batches, probe the model where it trains, choose the candidates with
    ``select`` (default: tune's, by eligibility and promise; ``modes`` exactly)."""
    eval_fn = shared.get("eval_fn")
    if eval_fn is not None and not callable(eval_fn):
        raise TypeError(
            f"eval_fn must be a function eval_fn(model) -> float, not {type(eval_fn).__name__}."
        )
    if eval_fn is not None:
        refuse_wrong_arity("eval_fn", eval_fn, "eval_fn(model) -> float", 1)
    check_seed(shared.get("seed", 0))
    batches = collect_batches(loader, _reading_within_budget(shared))
    held = HELDOUT_BATCHES if len(batches) >= 2 * HELDOUT_BATCHES else min(1, len(batches) - 1)
    train, heldout = (batches[:-held], batches[-held:]) if held else (batches, [])
    _warn_trained_heldout(train, heldout)
    _warn_accumulating_repeats(recipe.grad_accumulation_steps, len(train))
    lr_points = recipe.lr_points(model)  # a run that never moves is refused before anything
    note = scheduled_lr_note(recipe)
    if note is not None:
        logger.warning(note)
    recipe.name_groups_after(model)  # the trial model may be a copy on another device
    trial_model = model if _already_on(model, device) else deep_copy(model).to(torch.device(device))
    # judged for the device the trials run on, not the machine's first GPU (found by a hunt:
    # device="cpu" beside an H100 tried tf32 and FP8 on the CPU, "proven" on the H100)
    scanned = _scanned_copy_kept_apart(model, trial_model, train[0], recipe)
    report = probe(*scanned, device=model_device(trial_model))
    if report.layers is not None and report.layers.forward_autocast is not None:
        raise _forward_autocast_refusal(report.layers.forward_autocast, model)
    situation = Situation(
        hardware=report.hardware,
        device=report.device,
        layers=report.layers,
        backends=report.backends,
    )
    candidates = (select or _tune_candidates)(report, situation, modes)
    candidates = with_user_keep_fp32(candidates, shared.get("keep_fp32", ()), report)
    candidates = _without_lowering_nothing(candidates, model)
    candidates = _without_untranslatable(candidates, recipe.make_optimizer(model, trial_model))
    refuse_unrunnable(candidates, modes)
    if shared.get("compile"):
        compiled = tuple(spec.model_copy(update={"compile": True}) for spec in candidates.specs)
        candidates = candidates.model_copy(update={"specs": compiled})
    return RunSetup(
        user_model=model,
        trial_model=trial_model,
        recipe=recipe,
        train=train,
        heldout=heldout,
        report=report,
        situation=situation,
        candidates=candidates,
        lr_points=lr_points,
        **shared,
    )


class Calibration(NamedTuple):
    """What the fp32 calibration measured."""

    step_seconds: float
    """fp32 seconds per optimizer step."""
    seconds: float
    """Seconds the calibration took, its copies and ``eval_fn`` included."""
    draws_random: bool
    """Training drew random numbers: then a paired noise run is needed."""
    steps_run: int = CALIBRATION_STEPS
    """Fewer than planned: the deadline came first (the budget cannot hold a trial)."""


def calibration_run(setup: RunSetup) -> Calibration:
    """A few fp32 steps on copies of the batches: they check the inputs (the batches fit, the
    loss has gradients, ``eval_fn`` runs on the trained copy, whether training changes its
    batches in place: then ``setup.fresh_batches``) and time a step (``eval_fn``'s time counts
    in the overhead every run pays). They stop at the deadline, as every run does: a model of
    1.5 s steps was refused after 10.9 s of a 6 s budget."""
    start = setup.clock()
    setup.events.emit("phase", "calibration (fp32)", steps=CALIBRATION_STEPS)
    watched = WatchedBatches(setup.train)  # copies: the user's batches stay as they are
    optimizer = setup.recipe.optimizer
    user = UserModelWatch(
        setup.user_model,
        optimizer if isinstance(optimizer, torch.optim.Optimizer) else None,
        copy_weights=setup.recipe.train_step is not None,
    )
    outside = OutsideStateWatch(setup.recipe.train_step, setup.user_model)
    try:
        calibration = setup.run(
            setup.reference_spec,
            CALIBRATION_STEPS,
            batches=watched,
            watch_outside=False,  # watched here, after the check of the user's model
            eval_fn=setup.eval_fn,  # a broken eval_fn is found now, not after the reference
            stop=setup.events.watch(
                make_stop_check(None, "speed", setup.deadline, setup.clock), "calibration (fp32)"
            ),
        )
    except BaseException:  # Ctrl-C, a stop: whatever user code did to the model goes back
        user.restore()
        outside.restore()
        raise
    touched, moved = user.changed(), user.changed_values()
    if touched or moved:
        outside.restore()
        raise _trained_the_users_model(touched, moved, user.restore(), setup)
    changed_outside = outside.restore()  # compared once, put back where changed
    if changed_outside:
        raise _changed_outside_the_model(
            changed_outside, f"the fp32 calibration's {CALIBRATION_STEPS} steps"
        )
    setup.outside = outside  # its host copy puts back what a later run changes
    del user  # its host copy
    if calibration.record.failure is not None:
        raise reference_failed(calibration, setup)
    setup.fresh_batches = watched.changed()
    if setup.fresh_batches:
        logger.warning(FRESH_BATCHES_NOTE)
    record = calibration.record
    seconds = setup.clock() - start
    return Calibration(
        _step_seconds(record.median_step_seconds, record.windows, seconds, record.steps_run),
        seconds,
        record.draws_random,
        record.steps_run if record.stopped is not None else CALIBRATION_STEPS,
    )


def _step_seconds(
    median: float | None, windows: Sequence[StepWindow], seconds: float, steps_run: int
) -> float:
    """fp32 seconds per step: the timed windows' median; for a calibration the deadline cut
    short before any, its warm-up windows' pace, else its whole time per step."""
    if median:
        return median
    timed = sum(window.steps for window in windows)
    if timed:
        return sum(window.seconds for window in windows) / timed
    return seconds / max(steps_run, 1)


def calibrate(setup: RunSetup, budget_minutes: float) -> tuple[int, float]:
    """(trial steps, fp32 seconds per optimizer step)."""
    step_seconds, calibration_seconds, draws_random, steps_run = calibration_run(setup)
    # every candidate (the reference among them), the noise run and the paired run (other
    # draws, or nudged weights), and for a model with draws the nudged run beside it
    trials = len(setup.candidates.specs) + 2 + int(draws_random)
    # what a run costs beyond its steps (copying, converting, compiling): as calibration's
    overhead = max(0.0, calibration_seconds - steps_run * step_seconds)
    setup.run_overhead_seconds = overhead
    setup.retime_overhead_seconds = max(0.0, overhead - setup.tail_seconds)  # calibration's
    available = (setup.deadline - setup.clock() - trials * overhead) * (1 - BUDGET_RESERVE)
    steps = int(available / (trials * step_seconds * 1.5))
    cut_short = steps_run < CALIBRATION_STEPS  # the deadline came before its last step
    # the fp32 runs (reference and noise runs) must all fit, at the measured pace: a budget
    # that held 40 steps in all passed here and was refused during the noise runs, 7.4 s into
    # 7.8, without the budget it needs (found by a hunt)
    fp32_runs = trials - len(setup.candidates.specs) + 1
    fp32_short = setup.deadline - setup.clock() < fp32_runs * (
        overhead + MIN_TRIAL_STEPS * step_seconds
    )
    if (
        cut_short
        or fp32_short
        or (steps < MIN_TRIAL_STEPS and available < 2 * MIN_TRIAL_STEPS * step_seconds)
    ):
        # what every run needs for its shortest trial, on top of what is spent already
        used = budget_minutes * 60 - (setup.deadline - setup.clock())
        per_run = overhead + 1.5 * MIN_TRIAL_STEPS * step_seconds
        needed = used + trials * per_run / (1 - BUDGET_RESERVE)
        raise BudgetTooSmallError(
            budget_minutes,
            f"is too small: one fp32 step takes "
            f"{step_seconds:.3g} s and each of {trials} runs (the fp32 reference, its "
            f"{trials - len(setup.candidates.specs)} noise runs and every candidate) needs "
            f"{MIN_TRIAL_STEPS} steps and about {overhead:.3g} s beyond its steps (copying, "
            f"converting{', compiling' if setup.compile else ''}; calibration's). Give at least "
            f"{max(math.ceil(needed / 60 * 100) / 100, budget_minutes + 0.01):.2f} minutes "
            "(a run resuming a study keeps the study's budget, another budget being another "
            "run: on a busy machine, run it again, or start a new study).",
        )
    return max(MIN_TRIAL_STEPS, min(MAX_TRIAL_STEPS, steps)), step_seconds


class Fp32Run(NamedTuple):
    """One fp32 run of the reference and its noise runs: how it differs from the reference."""

    seed_offset: int
    shuffle_offset: int | None
    """Offset of the batch order's seed; None: the loader's own order, as the reference's."""
    label: str
    nudged: bool = False
    """Initial weights nudged by 2^-12 (the reference's seed, batches and draws)."""


REFERENCE_RUN = Fp32Run(0, None, "fp32 reference")
NOISE_RUN = Fp32Run(1, 1, "fp32 noise run")
"""Another seed and batch order: the noise of a whole run."""

PAIRED_RUN = Fp32Run(1, None, "fp32 paired noise run")
"""Other random draws on the same batches."""

NUDGED_RUN = Fp32Run(0, None, "fp32 paired noise run (weights nudged 2^-12)", nudged=True)
"""The paired run of a model without random draws: the same seed and batches, its initial
weights nudged by 2^-12. A second run would repeat the reference exactly, and a chaotic
training run does not repeat under any change (benchmarks/chaos_floor.py: one fp32 ulp
took small_convnet's outputs 10.9% apart in 82 steps, and amp_bf16, at 16.8%, was rejected by
the 10% floor; 2^-12, ``model_copies.NUDGE``, takes them 9.2% apart, amp_bf16 15.5%); a run
that is not chaotic stays within 0.1% and the floors apply as before. A model
with random draws gets it beside the paired run, for the trials that drew the reference's draws
(with dropout 0.2 before small_convnet's head, amp_bf16's outputs ended 14.6% apart and the
floor rejected it)."""


def reference_runs(
    setup: RunSetup, steps: int, budget_minutes: float, objective: Objective
) -> Fp32Runs:
    """The fp32 reference, the noise run (another seed and batch order) and the paired noise run
    on the same batches: another seed when the reference drew random numbers, else the same
    seed from weights nudged by 2^-12 (``NUDGED_RUN``). A model with random draws gets
    the nudged run too: the noise of a trial that drew the reference's draws."""
    references: list[TrialResult] = []
    runs = [REFERENCE_RUN, NOISE_RUN]
    while runs:
        run = runs.pop(0)
        label = run.label
        tail = setup.tail_seconds  # the slowest yet
        budget_only = make_stop_check(None, objective, setup.deadline, setup.clock, tail)
        setup.events.emit("phase", label, steps=steps)
        watched = None if setup.fresh_batches else WatchedBatches(setup.heldout, HELDOUT_BATCHES)
        result = setup.run(
            setup.reference_spec,
            steps,
            seed=setup.seed + run.seed_offset,
            shuffle_seed=None if run.shuffle_offset is None else setup.seed + run.shuffle_offset,
            heldout=setup.heldout if watched is None else watched,
            eval_fn=setup.eval_fn,
            nudge_seed=setup.seed if run.nudged else None,
            stop=setup.events.watch(budget_only, label),
        )
        if watched is not None and watched.changed():  # inputs changed in eval mode only
            setup.fresh_batches = True
        if result.record.failure is not None:
            raise reference_failed(result, setup, label)
        if result.record.stopped is not None:
            raise BudgetTooSmallError(
                budget_minutes, f"is too small for the {label} ({result.record.stopped})."
            )
        if not result.moved():
            raise _reference_still(result)
        _refuse_unscored_heldout(result, setup, label)
        score = result.record.eval_score
        if score is not None and not math.isfinite(score):
            raise ValueError(
                f"eval_fn returned {score} for the {label}: no mode can be judged against a "
                f"score that is not a number. {EVAL_FN_HINT}"
            )
        references.append(result)
        if len(references) == 1:
            runs += [PAIRED_RUN, NUDGED_RUN] if result.record.draws_random else [NUDGED_RUN]
    return Fp32Runs(*references)


@contextlib.contextmanager
def progress_callback(
    progress: bool | None, on_event: Callable[[SearchEvent], None] | None, *, screen: bool = False
) -> Iterator[Callable[[SearchEvent], None] | None]:
    """``on_event``, plus the live display on stderr when progress is wanted (``screen``: in
    the quality screen's words)."""
    from autoprec.progress import TuneProgress, interactive

    if on_event is not None and not callable(on_event):  # it failed at the first event
        raise TypeError(  # (found by a hunt)
            f"on_event must be a function on_event(event) -> None, not {type(on_event).__name__}."
        )
    if progress is not None and not isinstance(progress, bool):  # "yes" read as True
        raise TypeError(f"progress must be True, False or None (automatic), not {progress!r}.")
    if not (interactive() if progress is None else progress):
        yield on_event
        return
    with TuneProgress(screen=screen) as display:
        if on_event is None:
            yield display
            return

        def both(event: SearchEvent) -> None:
            display(event)
            on_event(event)

        yield both
