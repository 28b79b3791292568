"""The ``autoprec`` command line. ``main(argv) -> exit code``.

Errors print one line on stderr and exit with code 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from autoprec._version import __version__
from autoprec.errors import AutoprecError

EXIT_OK = 0
EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoprec",
        description="Pick the fastest training precision that does not hurt quality.",
    )
    parser.add_argument("--version", action="version", version=f"autoprec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    probe = commands.add_parser(
        "probe",
        help="what this machine (and a model) can train in, with reasons",
        description="Inspect GPUs, CPU, installed backends and optionally a model; give a "
        "verdict with reasons for every precision mode.",
    )
    probe.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="model factory, e.g. examples.tiny_gpt:make_model or path/to/file.py:make_model; "
        "it returns a model or (model, example_input)",
    )
    probe.add_argument("--device", help="cpu, cuda, cuda:N or N (default: first GPU, else cpu)")
    probe.add_argument("--json", action="store_true", help="print the report as JSON")
    probe.add_argument(
        "--import-backends",
        action="store_true",
        help="also import each installed backend to check that it works (takes seconds)",
    )
    probe.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    show = commands.add_parser(
        "show",
        help="print a profile readably",
        description="Validate a profile and print its mode, knobs, hardware and evidence.",
    )
    show.add_argument("profile", metavar="PROFILE", help="path to a profile JSON file")
    show.add_argument("--json", action="store_true", help="print the validated profile as JSON")
    show.add_argument(
        "--strict", action="store_true", help="fail when this hardware differs from the proven"
    )
    show.add_argument("--debug", action="store_true", help="show tracebacks")
    tune = commands.add_parser(
        "tune",
        help="find the fastest precision that passes the drift gate, write a profile",
        description="Run short measured trials of every eligible mode within a time budget, "
        "reject those that drift from fp32, and write the winner as a profile. Interrupted runs "
        "resume from the study file next to the output.",
    )
    tune.add_argument(
        "model", metavar="MODEL_FACTORY", help="module.path:factory or file.py:factory"
    )
    tune.add_argument(
        "--data",
        required=True,
        metavar="LOADER_FACTORY",
        help="factory returning an iterable of batches (a DataLoader, a list)",
    )
    tune.add_argument(
        "--budget",
        required=True,
        type=float,
        metavar="MINUTES",
        help="hard wall for the whole search, in minutes",
    )
    tune.add_argument("--out", required=True, metavar="PROFILE.json", help="profile to write")
    tune.add_argument("--loss", metavar="MODULE:FN", help="loss_fn(output, target)")
    tune.add_argument(
        "--eval",
        metavar="MODULE:FN",
        help="eval_fn(model) -> float, lower is better, judged against fp32",
    )
    recipe = tune.add_argument_group(
        "training recipe",
        "How your real run trains: trials run it, so the verdict holds for it. Without these, "
        "trials train with AdamW(lr=3e-4), no schedule, no accumulation, no clipping.",
    )
    recipe.add_argument(
        "--optimizer",
        metavar="MODULE:FACTORY",
        help="factory params -> optimizer, e.g. mytrain:make_optimizer (called with lr=--lr "
        "when --lr is given)",
    )
    recipe.add_argument(
        "--lr", type=float, help="learning rate (peak lr under a schedule); default 3e-4"
    )
    recipe.add_argument(
        "--scheduler",
        metavar="MODULE:FACTORY",
        help="factory optimizer -> LRScheduler (gets total_steps=N if it takes total_steps); "
        "needs --total-steps",
    )
    recipe.add_argument(
        "--total-steps", type=int, metavar="N", help="optimizer steps of your real run"
    )
    recipe.add_argument(
        "--grad-accum", type=int, default=1, metavar="K", help="micro-batches per optimizer step"
    )
    recipe.add_argument("--clip", type=float, metavar="NORM", help="clip gradients to this norm")
    tune.add_argument("--objective", choices=["speed", "memory", "balanced"], default="speed")
    tune.add_argument("--modes", help="comma-separated canonical modes to consider")
    tune.add_argument(
        "--storage", metavar="URL", help="Optuna storage URL (default: sqlite file next to --out)"
    )
    tune.add_argument("--study", metavar="NAME", help="study name (default: the --out file name)")
    tune.add_argument("--device", help="cpu or cuda:N (default: where the model is)")
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    report = commands.add_parser(
        "report",
        help="plot speed vs memory of every trial",
        description="Draw samples/s against memory for every trial of a tune run (its "
        "*.trials.json) or an Optuna study (a .db file or storage URL).",
    )
    report.add_argument("source", metavar="STUDY_OR_RESULT")
    report.add_argument("--out", required=True, metavar="FILE.png")
    report.add_argument("--study", metavar="NAME", help="study name inside a storage")
    report.add_argument("--debug", action="store_true", help="show tracebacks")
    schema = commands.add_parser(
        "schema",
        help="print the profile JSON schema",
        description="Print the JSON schema of profile files (profiles/profile.schema.json).",
    )
    schema.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser


def _probe(args: argparse.Namespace) -> int:
    from autoprec.factories import load_model
    from autoprec.probing import probe

    model, example_input = load_model(args.model) if args.model else (None, None)
    report = probe(model, example_input, device=args.device, import_backends=args.import_backends)
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        from autoprec.display import print_probe_report

        print_probe_report(report)
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    import warnings

    from autoprec.errors import HardwareMismatchWarning
    from autoprec.profile import load_profile

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", HardwareMismatchWarning)
        profile = load_profile(args.profile, strict=args.strict)
    mismatch = [str(w.message) for w in caught if issubclass(w.category, HardwareMismatchWarning)]
    if args.json:
        sys.stdout.write(profile.model_dump_json(indent=2) + "\n")
    else:
        from autoprec.display import print_profile

        print_profile(profile, mismatch)
    return EXIT_OK


def _schema(args: argparse.Namespace) -> int:
    import json

    from autoprec.profile import Profile

    sys.stdout.write(json.dumps(Profile.model_json_schema(), indent=2) + "\n")
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
        takes_lr = "lr" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_lr = False
    if not takes_lr:
        raise ValueError(
            f"--lr: the --optimizer factory {reference!r} takes no lr argument; set the lr "
            "inside the factory, or give it an lr parameter."
        )
    return functools.partial(factory, lr=lr)


def _check_tune_numbers(args: argparse.Namespace) -> None:
    if not args.budget > 0:
        raise ValueError(f"--budget must be a positive number of minutes, not {args.budget:g}.")
    if args.total_steps is not None and args.total_steps < 1:
        raise ValueError(f"--total-steps must be >= 1, not {args.total_steps}.")
    if args.grad_accum < 1:
        raise ValueError(f"--grad-accum must be >= 1, not {args.grad_accum}.")
    if args.clip is not None and not args.clip > 0:
        raise ValueError(f"--clip must be a positive norm, not {args.clip:g}.")


def _tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from autoprec._files import write_text_atomically
    from autoprec.display import TuneProgress, print_profile, tune_table
    from autoprec.factories import load_model, load_object
    from autoprec.tuning import tune

    model, _ = load_model(args.model)
    data = load_object(args.data, option="--data")
    loader = data() if callable(data) else data
    loss_fn = load_object(args.loss, option="--loss") if args.loss else None
    eval_fn = load_object(args.eval, option="--eval") if args.eval else None
    optimizer = _optimizer_factory(args.optimizer, args.lr)
    scheduler = load_object(args.scheduler, option="--scheduler") if args.scheduler else None
    _check_tune_numbers(args)  # before anything is created
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    storage = args.storage or f"sqlite:///{out.with_suffix('.study.db')}"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else None
    with TuneProgress() as progress:
        result = tune(
            model,
            loader,
            args.budget,
            loss_fn=loss_fn,
            eval_fn=eval_fn,
            optimizer=optimizer,
            scheduler=scheduler,
            total_steps=args.total_steps,
            grad_accumulation_steps=args.grad_accum,
            clip_grad_norm=args.clip,
            objective=args.objective,
            modes=modes,
            device=args.device,
            storage=storage,
            study_name=args.study or out.stem,
            seed=args.seed,
            on_event=progress,
        )
    from rich.console import Console

    console = Console()
    console.print(tune_table(result))
    result.profile.save(out)
    trials = out.with_suffix(".trials.json")
    write_text_atomically(trials, result.model_dump_json(indent=2) + "\n")
    print_profile(result.profile, console=console)
    console.print(f"wrote {out} (trials: {trials}; study: {storage})", soft_wrap=True)
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from autoprec.report import outcomes_from_result, outcomes_from_study, plot_outcomes

    source = args.source
    if source.endswith(".json"):
        outcomes, chosen = outcomes_from_result(source)
    else:
        storage = f"sqlite:///{source}" if Path(source).exists() else source
        outcomes, chosen = outcomes_from_study(storage, args.study)
    written = plot_outcomes(outcomes, chosen, args.out, title=f"autoprec: {Path(source).name}")
    sys.stdout.write(f"wrote {written} ({len(outcomes)} trials, chosen: {chosen or 'none'})\n")
    return EXIT_OK


_COMMANDS = {
    "probe": _probe,
    "show": _show,
    "schema": _schema,
    "tune": _tune,
    "report": _report,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="autoprec: %(levelname)s: %(message)s",
    )
    try:
        return _COMMANDS[args.command](args)
    except (AutoprecError, ValueError, TypeError, FileNotFoundError) as error:
        if args.debug:
            raise
        sys.stderr.write(f"autoprec: error: {error}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        resume = (
            "; run the same command again to resume: finished trials are kept in the study"
            if args.command == "tune"
            else ""
        )
        sys.stderr.write(f"autoprec: interrupted{resume}\n")
        return 130
