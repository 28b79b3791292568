"""The ``autoprec`` command line. ``main(argv) -> exit code``.

Errors print one line on stderr and exit with code 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from autoprec._imports import IMPORT_CHATTER, demote_import_chatter
from autoprec.cli_parser import build_parser
from autoprec.errors import AutoprecError, BudgetTooSmallError
from autoprec.interrupts import Terminated, remembered_interrupts

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_FAILURE = 1


def _probe(args: argparse.Namespace) -> int:
    from autoprec.factories import load_model
    from autoprec.probing import probe

    model, example_input = load_model(args.model) if args.model else (None, None)
    report = probe(model, example_input, device=args.device, import_backends=args.import_backends)
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        from autoprec.display_probe import print_probe_report

        print_probe_report(report)
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    import warnings

    from autoprec.errors import HardwareMismatchWarning, UnprovenProfileWarning
    from autoprec.profile import load_profile

    shown = (HardwareMismatchWarning, UnprovenProfileWarning)  # printed with the profile
    with warnings.catch_warnings(record=True) as caught:
        for category in shown:
            warnings.simplefilter("always", category)
        profile = load_profile(args.profile, strict=args.strict)
    said = [str(w.message) for w in caught if issubclass(w.category, shown)]
    if args.json:
        sys.stdout.write(profile.model_dump_json(indent=2) + "\n")
        for message in said:  # the JSON stays the profile's; the warning is not dropped
            sys.stderr.write(f"autoprec: warning: {message}\n")
    else:
        from autoprec.display import print_profile

        print_profile(profile, said)
    return EXIT_OK


def _schema(args: argparse.Namespace) -> int:
    import json

    from autoprec.profile import published_schema

    sys.stdout.write(json.dumps(published_schema(), indent=2) + "\n")
    return EXIT_OK


def _optimizer_factory(reference: str | None, lr: float | None) -> Any:
    """The ``params -> optimizer`` factory that --optimizer and --lr describe (None: default)."""
    import functools
    import inspect

    from autoprec.factories import load_object

    if reference is None:
        if lr is None:
            return None
        import torch

        return functools.partial(torch.optim.AdamW, lr=lr)
    factory = load_object(reference, option="--optimizer")
    if not callable(factory):
        raise TypeError(
            f"--optimizer: {reference!r} is a {type(factory).__name__}, not a factory "
            "params -> optimizer."
        )
    if lr is None:
        return factory
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        parameters = []  # type: ignore[assignment]
    takes_lr = any(  # lr by name, or **options (found by a hunt: refused though it takes lr)
        p.name == "lr" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
    )
    if not takes_lr:
        raise ValueError(
            f"--lr: the --optimizer factory {reference!r} takes no lr argument; set the lr "
            "inside the factory, or give it an lr parameter."
        )
    return functools.partial(factory, lr=lr)


def _check_tune_numbers(args: argparse.Namespace) -> None:
    from autoprec.run_inputs import MAX_BUDGET_MINUTES

    if not 0 < args.budget <= MAX_BUDGET_MINUTES:  # nan fails both
        raise ValueError(
            f"--budget must be a positive, finite number of minutes up to "
            f"{MAX_BUDGET_MINUTES:g}, not {args.budget:g} "
            "(`autoprec check` screens every mode without a budget)."
        )
    _check_recipe_numbers(args)


def _check_recipe_numbers(args: argparse.Namespace) -> None:
    """The recipe's numbers, named by their flags (the Python API's names confused a CLI user:
    "clip_grad_norm must be positive")."""
    if args.total_steps is not None and args.total_steps < 1:
        raise ValueError(f"--total-steps must be >= 1, not {args.total_steps}.")
    if args.grad_accum < 1:
        raise ValueError(f"--grad-accum must be >= 1, not {args.grad_accum}.")
    if args.clip is not None and not args.clip > 0:
        raise ValueError(f"--clip must be a positive norm, not {args.clip:g}.")
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        raise ValueError(f"--lr must be a positive, finite learning rate, not {args.lr:g}.")
    if args.loss and args.train_step:
        raise ValueError(
            "Pass --loss or --train-step, not both: --train-step computes the loss itself."
        )
    if args.scheduler and args.total_steps is None:
        raise ValueError(
            "--scheduler needs --total-steps (your run's optimizer steps): the trials train at "
            "the learning rates the schedule reaches over them."
        )
    if args.total_steps is not None and not args.scheduler:
        raise ValueError(
            "--total-steps is read only with --scheduler (it places the schedule's peak and "
            "floor); without one the lr is constant. Pass --scheduler too, or leave it out."
        )


def _loader(reference: str) -> Any:
    """The batches --data names: a loader, or a factory called with no arguments."""
    from autoprec.factories import load_object, user_code_failed

    data = load_object(reference, option="--data")
    if not callable(data):
        return data
    try:
        return data()
    except (Exception, SystemExit) as error:
        raise user_code_failed("--data", f"calling {reference!r}()", error) from error


def _thresholds(settings: list[str]) -> Any:
    """The DriftThresholds that --threshold NAME=VALUE options set (None: the defaults)."""
    if not settings:
        return None
    from pydantic import ValidationError

    from autoprec.drift_thresholds import DriftThresholds
    from autoprec.errors import field_errors

    known = list(DriftThresholds.model_fields)
    values: dict[str, float] = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if name.strip() not in known:
            raise ValueError(
                f"--threshold {setting!r}: no threshold {name.strip()!r}; known: "
                f"{', '.join(known)}."
            )
        try:
            values[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--threshold {setting!r}: {value!r} is not a number.") from None
    try:
        return DriftThresholds(**values)
    except ValidationError as error:
        raise ValueError(f"--threshold: {field_errors(error)}.") from None


def _stepped_optimizer(
    model: Any,
    factory: Any,
    path: str,
    read: Any,
    lr_given: bool = False,
    own_factory: bool = True,
) -> Any:
    """The run's optimizer: ``factory`` (None: autoprec's default) over ``model``, its state
    loaded from ``path`` (``read``: that file already read, or None). ``lr_given``: ``--lr``
    was given, and each group keeps the lr the factory gives it (over the checkpoint's, and as
    a scheduler's base: ``initial_lr``). It set one lr for every group, flattening a factory's
    10x head, and a scheduler rebuilt the lrs from the checkpoint's ``initial_lr``, so --lr did
    nothing while the report recorded it (found by a hunt)."""
    from autoprec.factories import load_optimizer_state
    from autoprec.recipe import default_optimizer

    optimizer = (factory or default_optimizer)(model.parameters())
    built = [dict(group) for group in optimizer.param_groups]
    load_optimizer_state(optimizer, path, read=read)
    if lr_given:  # the lr the run ends at, over the one saved with the state
        for group, before in zip(optimizer.param_groups, built, strict=False):
            group["lr"] = before["lr"]
            if "initial_lr" in group:
                group["initial_lr"] = before["lr"]
    replaced = _replaced_settings(built, optimizer.param_groups)
    if own_factory and factory is not None and replaced:  # --lr alone: autoprec's AdamW
        logging.getLogger("autoprec.cli").warning(
            "--optimizer-state: the checkpoint's settings replace --optimizer's, as torch's "
            "load_state_dict does (every trial trains with them): %s",
            "; ".join(replaced),
        )
    return optimizer


_NOT_SETTINGS = frozenset(
    {"params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"}
)
"""Group keys a loaded checkpoint may change without a word: the lr (documented: the saved lr
wins, ``--lr`` overrides it) and implementation flags."""


def _replaced_settings(built: list[dict[str, Any]], loaded: list[dict[str, Any]]) -> list[str]:
    """``name before -> after`` for each group setting a load changed (found by a hunt: the
    checkpoint's betas and weight decay silently replaced the --optimizer factory's)."""
    changes = []
    for index, (before, after) in enumerate(zip(built, loaded, strict=False)):
        for key in sorted(set(before) - _NOT_SETTINGS):
            old, new = before[key], after.get(key)
            try:
                same = bool(old == new)
            except Exception:  # noqa: BLE001 - a tensor-valued setting: compared by identity
                same = old is new
            if not same:
                changes.append(f"group {index} {key} {old!r} -> {new!r}")
    return changes


def _training_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """The model, batches and recipe the command line names, as keyword arguments."""
    from autoprec.factories import load_model, load_object, load_weights, read_checkpoint

    thresholds = _thresholds(args.threshold)  # before the model loads: a typo fails at once
    if args.optimizer_state == "" and not args.weights:
        raise ValueError(
            "--optimizer-state without a FILE reads the --weights checkpoint: pass --weights, "
            "or --optimizer-state FILE."
        )
    model, _ = load_model(args.model, option="MODEL_FACTORY")
    read = None  # a checkpoint holding weights and optimizer state is read once
    if args.weights:
        read = read_checkpoint(args.weights, "--weights", "weights")
        load_weights(model, args.weights, read=read)
    optimizer = _optimizer_factory(args.optimizer, args.lr)
    if args.optimizer_state is not None:
        own_file = args.optimizer_state != ""
        path = args.optimizer_state if own_file else args.weights
        optimizer = _stepped_optimizer(
            model,
            optimizer,
            path,
            None if own_file else read,
            lr_given=args.lr is not None,
            own_factory=args.optimizer is not None,
        )
    return {
        "model": model,
        "loader": _loader(args.data),
        "loss_fn": load_object(args.loss, option="--loss") if args.loss else None,
        "train_step": (
            load_object(args.train_step, option="--train-step") if args.train_step else None
        ),
        "eval_fn": load_object(args.eval, option="--eval") if args.eval else None,
        "optimizer": optimizer,
        "scheduler": load_object(args.scheduler, option="--scheduler") if args.scheduler else None,
        "total_steps": args.total_steps,
        "grad_accumulation_steps": args.grad_accum,
        "clip_grad_norm": args.clip,
        "modes": _modes(args.modes),
        "keep_fp32": args.keep_fp32 or None,
        "device": args.device,
        "seed": args.seed,
        "thresholds": thresholds,
        "compile": "auto" if args.compile is None else args.compile,
    }


def _modes(given: str | None) -> list[str] | None:
    """The modes --modes names (None: every mode); naming none is refused in the CLI's terms
    (it said "pass None for every mode")."""
    if given is None:
        return None
    modes = [mode.strip() for mode in given.split(",") if mode.strip()]
    if not modes:
        raise ValueError(
            f"--modes {given!r} names no mode: give them comma-separated (e.g. "
            "--modes amp_bf16,bf16_sr), or leave --modes out for every mode."
        )
    return modes


def _refuse_replacing_other_files(out: Path) -> None:
    """Refuse an existing ``--out`` that is not an autoprec profile: ``--out train.py`` replaced
    the model's own script with a profile, exit 0 (found by a hunt). An earlier profile is
    replaced, as a re-run expects."""
    import json

    if not out.is_file() or out.stat().st_size == 0:
        return
    try:
        data = json.loads(out.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError):
        data = None
    if not (isinstance(data, dict) and "schema_version" in data):
        raise ValueError(
            f"--out {str(out)!r} exists and is not an autoprec profile: it would be replaced. "
            "Give another file name, or move that file aside first."
        )


def _tune(args: argparse.Namespace) -> int:

    from rich.console import Console

    from autoprec._files import check_writable, write_text_atomically
    from autoprec.display import print_profile, tune_table
    from autoprec.progress import TuneProgress
    from autoprec.search import shown_storage, sqlite_url
    from autoprec.tuning import tune

    _check_tune_numbers(args)
    inputs = _training_inputs(args)
    out = Path(args.out)
    if out.is_dir() or args.out.endswith(("/", os.sep)):
        raise ValueError(
            f"--out {args.out!r} names a folder; give the profile's file name (e.g. "
            f"{str(out / 'profile.json')!r})."
        )
    check_writable(out)  # /dev/null, a pipe, /proc/p.json: refused before any trial, not after
    _refuse_replacing_other_files(out)
    trials = beside_profile(out, ".trials.json")
    check_writable(trials)  # written beside it, after the run
    # No folder is made here: tune() creates the study's (an SQLite file's folder) only after
    # the first fp32 steps have checked the inputs.
    storage = args.storage or sqlite_url(beside_profile(out, ".study.db"))
    with TuneProgress() as progress:
        result = tune(
            budget_minutes=args.budget,
            objective=args.objective,
            storage=storage,
            study_name=args.study or profile_stem(out),
            on_event=progress,
            progress=False,
            **inputs,
        )
    console = Console()
    console.print(tune_table(result, wide=args.wide))
    # the trials file first: a profile beside the last run's trials file read as this run's
    # when the second write failed (a full disk, a SIGTERM between them; found by a hunt)
    write_text_atomically(trials, result.model_dump_json(indent=2) + "\n")
    result.profile.save(out)
    print_profile(result.profile, console=console)
    shown = shown_storage(storage)
    console.print(  # paths as they are: "sweep[lr]/p.json" is no rich markup
        f"wrote {out}\n  every trial: {trials}\n  study: {shown}", soft_wrap=True, markup=False
    )
    return EXIT_OK


def profile_stem(out: Path) -> str:
    """The profile's name without ``.json``: ``runs/llama-3.1`` is ``llama-3.1`` (its
    ``Path.stem``, ``llama-3``, made ``llama-3.1`` and ``llama-3.2`` share one study)."""
    return out.stem if out.suffix.lower() == ".json" else out.name


def beside_profile(out: Path, suffix: str) -> Path:
    """The file written next to the profile: ``x.json`` -> ``x<suffix>``."""
    return out.with_name(profile_stem(out) + suffix)


def _check(args: argparse.Namespace) -> int:
    from rich.console import Console

    from autoprec.display import quality_table
    from autoprec.progress import TuneProgress
    from autoprec.screening import check

    if args.steps < 4:
        raise ValueError(f"--steps must be >= 4, not {args.steps}.")
    _check_recipe_numbers(args)
    inputs = _training_inputs(args)
    with TuneProgress() as progress:
        report = check(
            steps=args.steps,
            on_event=progress,
            progress=False,
            max_trial_minutes=args.max_trial_minutes,
            **inputs,
        )
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        Console().print(quality_table(report))
    return EXIT_OK


def _written_by_tune(path: Path) -> bool:
    """A trials file renamed (``T.JSON``, ``copy.txt``): ``autoprec tune`` writes it indented,
    its first line a lone ``{``; an Optuna journal's every line is a whole JSON object."""
    if not path.is_file():
        return False
    with path.open("rb") as file:
        return file.readline().strip() == b"{"


def _report(args: argparse.Namespace) -> int:
    from autoprec._files import check_writable
    from autoprec.report import (
        outcomes_from_result,
        outcomes_from_study,
        plot_outcomes,
        trials_run,
    )
    from autoprec.search import is_journal_file

    source = args.source
    given = "give a tune run's *.trials.json, its *.study.db, a journal file or a storage URL"
    if "://" not in source and not Path(source).exists():
        raise FileNotFoundError(f"{source!r} does not exist; {given}.")
    if "://" not in source and Path(source).is_dir():
        raise ValueError(f"{source!r} is a folder; {given}.")
    check_writable(args.out)  # a folder, /dev/null: refused before anything is read
    # by content first: a journal storage may be named study.json (report read it as a
    # trials file and failed on its second line)
    path = Path(source)
    if _written_by_tune(path) or (source.endswith(".json") and not is_journal_file(path)):
        if args.study is not None:
            raise ValueError(
                f"--study names a study in a storage; {source!r} is a tune run's trials file, "
                "which holds one run. Leave --study out, or give the study's .db or URL."
            )
        outcomes, chosen, noise_runs = outcomes_from_result(source)
    else:
        outcomes, chosen, noise_runs = outcomes_from_study(source, args.study)
    written = plot_outcomes(outcomes, chosen, args.out, title=f"autoprec: {Path(source).name}")
    count = trials_run(outcomes, noise_runs)
    noise = "the fp32 noise run" if noise_runs == 1 else f"{noise_runs} fp32 noise runs"
    # a trial without both figures is not drawn (a failed one): said, not hidden (a hunt)
    unplotted = [o.label for o in outcomes if not (o.samples_per_second and o.memory_bytes)]
    left_out = f"; not drawn, without figures: {', '.join(unplotted)}" if unplotted else ""
    sys.stdout.write(
        f"wrote {written} ({count} trials: {count - noise_runs} modes run and {noise}; "
        f"chosen: {chosen or 'none'}{left_out})\n"
    )
    return EXIT_OK


_COMMANDS = {
    "probe": _probe,
    "show": _show,
    "schema": _schema,
    "tune": _tune,
    "check": _check,
    "report": _report,
}


class _CliHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The CLI's own handlers (replaced, not stacked, when main() runs again in one process).
    Each record goes to ``sys.stderr`` as it is then: the live progress display redirects it
    to print above its status line, and a handler holding the stderr of its creation glued
    warnings onto that line ("...probing the model...autoprec: WARNING: ..."; found by a
    hunt)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        del value  # always the current sys.stderr


def _install(logger: logging.Logger, form: str, *, others_only: bool = False) -> None:
    for handler in [h for h in logger.handlers if isinstance(h, _CliHandler)]:
        logger.removeHandler(handler)
    handler = _CliHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(form))
    if others_only:  # autoprec's records have their own handler
        handler.addFilter(lambda record: not record.name.startswith("autoprec"))
    logger.addHandler(handler)


def _configure_logging(debug: bool) -> None:
    """autoprec's records as ``autoprec: LEVEL: message``; every other library's under its own
    logger name; known import chatter of the backends only with ``--debug``."""
    level = logging.DEBUG if debug else logging.WARNING
    own = logging.getLogger("autoprec")
    _install(own, "autoprec: %(levelname)s: %(message)s")
    own.setLevel(level)
    root = logging.getLogger()
    _install(root, "%(name)s: %(levelname)s: %(message)s", others_only=True)
    root.setLevel(level)
    demote_import_chatter(not debug)


CLI_WORDS: tuple[tuple[str, str], ...] = (
    ("keep_fp32 pattern ", "--keep-fp32 pattern "),
    ("keep_fp32 holds ", "--keep-fp32 holds "),
    ("keep_fp32 [", "--keep-fp32 ["),
    ("modes=[", "--modes ["),
    ("or pass None for every mode", "or leave --modes out for every mode"),
    ("Pass scheduler=None (tune_module and tune_trainer take it too)", "Leave --scheduler out"),
    ("budget_minutes (", "--budget ("),
    ("warm-up (scheduler=)", "warm-up (--scheduler)"),
    ("clip gradients (clip_grad_norm=)", "clip gradients (--clip)"),
    (
        "max_trial_minutes must be a number of minutes > 0 (or None)",
        "--max-trial-minutes must be > 0",
    ),
)
"""Phrases of the Python API's errors in the command line's terms (found by a hunt: a CLI user
was told to "pass None for every mode" or about "keep_fp32 pattern")."""


def in_cli_words(message: str) -> str:
    for python, flag in CLI_WORDS:
        message = message.replace(python, flag)
    return message


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """``sys.path`` and the loggers the CLI sets up, as they were after ``main()``: called in
    a process of your own (a notebook, a test), it left the working folder on ``sys.path`` and
    the root logger at WARNING with autoprec's handler (found by a hunt)."""
    path = list(sys.path)
    names = ["", "autoprec", *(name for name, _ in IMPORT_CHATTER)]
    loggers = [logging.getLogger(name) for name in names]
    saved = [(list(lg.handlers), lg.level, list(lg.filters)) for lg in loggers]
    try:
        yield
    finally:
        sys.path[:] = path
        for logger, (handlers, level, filters) in zip(loggers, saved, strict=True):
            logger.handlers[:], logger.filters[:] = handlers, filters
            logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    with _process_state_kept():
        return _main(argv)


def _innermost(error: BaseException) -> BaseException:
    """The first cause of ``error``: optuna's storage error always says "An exception is raised
    during the commit ..."; SQLite's "database or disk is full" is its cause (a review)."""
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    return error


def _resume_advice(command: str, error: BaseException) -> str:
    """What to do after a failed write: free space where the disk is full; a tune resumes."""
    if command != "tune":
        return ""
    cause = _innermost(error)
    full = getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
        "disk is full" in str(cause)  # SQLite's words; never a path's (a review)
    )
    fix = "free space and run" if full else "fix that and run"
    return f"; the study keeps every finished trial: {fix} the same command again to resume"


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare `autoprec`: the commands
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    _configure_logging(args.debug)
    try:
        with remembered_interrupts():
            return _COMMANDS[args.command](args)
    except (AutoprecError, ValueError, TypeError, FileNotFoundError) as error:
        if args.debug:
            raise
        said = error.naming("--budget") if isinstance(error, BudgetTooSmallError) else error
        sys.stderr.write(f"autoprec: error: {in_cli_words(str(said))}\n")
        return EXIT_USAGE
    except OSError as error:  # a full disk or a failing write: a traceback before (a hunt)
        if args.debug:
            raise
        sys.stderr.write(f"autoprec: error: {error}{_resume_advice(args.command, error)}\n")
        return EXIT_FAILURE
    except Exception as error:
        if args.debug or type(error).__name__ != "StorageInternalError":
            raise
        # optuna's, e.g. SQLite's "database or disk is full": a traceback before (a review)
        cause = _innermost(error)
        found = (str(cause) or type(cause).__name__).splitlines()[0]
        said = f"the study's storage failed ({found})"
        sys.stderr.write(f"autoprec: error: {said}{_resume_advice(args.command, error)}\n")
        return EXIT_FAILURE
    except KeyboardInterrupt as interrupt:
        resume = (
            "; run the same command again to resume: finished trials are kept in the study"
            if args.command == "tune"
            else ""
        )
        terminated = isinstance(interrupt, Terminated)
        sys.stderr.write(f"autoprec: {'terminated' if terminated else 'interrupted'}{resume}\n")
        return 143 if terminated else 130
