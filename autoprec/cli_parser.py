"""The ``autoprec`` command line's arguments: every command, option and help text."""

from __future__ import annotations

import argparse
from typing import NoReturn

from autoprec._version import __version__


class _Parser(argparse.ArgumentParser):
    """A usage error in one line, as every other refusal: argparse printed the command's whole
    usage (12 lines for tune) above "argument --budget: invalid float value: 'abc'" (found by
    a hunt). The line names ``--help`` for the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`).\n")


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its data and the training recipe: what tune and check both run."""
    parser.add_argument(
        "model", metavar="MODEL_FACTORY", help="module.path:factory or file.py:factory"
    )
    parser.add_argument(
        "--data",
        required=True,
        metavar="LOADER_FACTORY",
        help="factory returning an iterable of batches (a DataLoader, a list)",
    )
    parser.add_argument(
        "--weights",
        metavar="CHECKPOINT.pt",
        help="a state dict (torch.save) loaded into the model before any trial: check or tune "
        "from a late checkpoint of your run (with --lr at the lr it ends at) to see costs that "
        "show only at a low loss, such as FP8's",
    )
    parser.add_argument(
        "--optimizer-state",
        nargs="?",
        const="",
        metavar="FILE",
        help="start every trial from your run's optimizer state (Adam's moments), as the run "
        "continues: the one in the --weights checkpoint (under 'optimizer', "
        "'optimizer_state_dict', 'optim' or 'optimizer_states'), or FILE (a Hugging Face "
        "Trainer's optimizer.pt); its settings (lr, betas, weight decay) are the run's there, "
        "as torch's load_state_dict makes them (a warning names those that replace "
        "--optimizer's), the lr unless --lr is given",
    )
    parser.add_argument("--loss", metavar="MODULE:FN", help="loss_fn(output, target)")
    parser.add_argument(
        "--train-step",
        metavar="MODULE:FN",
        help="train_step(plan, batch) -> loss, for anything else (instead of --loss)",
    )
    parser.add_argument(
        "--eval",
        metavar="MODULE:FN",
        help="eval_fn(model) -> float, lower is better, judged against fp32",
    )
    recipe = parser.add_argument_group(
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
        "--lr",
        type=float,
        help="learning rate (peak lr under a schedule); default: --optimizer's own, the "
        "checkpoint's with --optimizer-state, else 3e-4 (AdamW)",
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
    recipe.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train every run with torch.compile, as the profile's apply() then does "
        "(default: when the model factory returns a compiled model)",
    )
    parser.add_argument(
        "--modes",
        help="comma-separated modes, exactly (e.g. amp_bf16,bf16_kahan; "
        "amp_bf16+8bit-optim for 8-bit optimizer states); a mode that cannot run here is an "
        "error",
    )
    parser.add_argument(
        "--keep-fp32",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep these modules in fp32 in every mode that lowers precision (repeatable; a "
        "module name as named_modules() gives it, or a pattern such as 'blocks.*.ln_1')",
    )
    parser.add_argument("--device", help="cpu or cuda:N (default: where the model is)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of every run's random draws (dropout, stochastic rounding); the fp32 noise "
        "runs use seed + 1 (default 0)",
    )
    parser.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set one drift-gate threshold (repeatable), e.g. max_rounded_beta2=0.9995 to judge "
        "bf16 optimizer states by the trial alone; names: the fields of "
        "autoprec.drift_thresholds.DriftThresholds",
    )


def build_parser() -> argparse.ArgumentParser:
    """Every command and option of ``autoprec`` (``--help`` prints them)."""
    parser = _Parser(
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
        "--strict",
        action="store_true",
        help="fail when this hardware differs from the proven, or the profile carries no "
        "evidence (written by hand: never trained against fp32)",
    )
    show.add_argument("--debug", action="store_true", help="show tracebacks")
    tune = commands.add_parser(
        "tune",
        help="find the fastest precision that passes the drift gate, write a profile",
        description="Run short measured trials of every eligible mode within a time budget, "
        "reject those that drift from fp32, and write the winner as a profile. Interrupted runs "
        "resume from the study file next to the output.",
    )
    _add_training_arguments(tune)
    tune.add_argument(
        "--budget",
        required=True,
        type=float,
        metavar="MINUTES",
        help="hard wall for the whole search, in minutes",
    )
    tune.add_argument("--out", required=True, metavar="PROFILE.json", help="profile to write")
    tune.add_argument("--objective", choices=["speed", "memory", "balanced"], default="speed")
    tune.add_argument(
        "--storage",
        metavar="URL",
        help="Optuna storage URL, or a file path for a journal file (default: sqlite file next "
        "to --out)",
    )
    tune.add_argument("--study", metavar="NAME", help="study name (default: the --out file name)")
    tune.add_argument(
        "--wide",
        "--verbose",
        action="store_true",
        help="the full trial table: every reason, every skipped mode's reasons",
    )
    tune.add_argument(
        "--debug",
        action="store_true",
        help="show tracebacks, debug logs and the backends' import messages",
    )
    check = commands.add_parser(
        "check",
        help="would a precision mode hurt this model? every mode through the drift gate",
        description="A quality screen: every mode whose numerics run here (FP8 via torchao "
        "emulated where the hardware has none) trains your recipe from the same weights and "
        "batches as fp32 and goes through the drift gate, whatever its speed. Prints safe / "
        "unsafe with every reason; writes nothing.",
    )
    _add_training_arguments(check)
    check.add_argument(
        "--steps",
        type=int,
        default=200,
        metavar="N",
        help="optimizer steps per mode (default 200, as a tune trial)",
    )
    check.add_argument(
        "--max-trial-minutes",
        type=float,
        metavar="M",
        help="stop a mode whose trial runs longer than M minutes, or whose pace says it would, "
        "and report it as stopped, not judged (default: no limit; progress shows each "
        "trial's pace and time to go)",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
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
