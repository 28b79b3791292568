"""Speed vs memory of every trial, as a PNG: rejected marked, the chosen one highlighted."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from autoprec._files import atomic_target, read_json, write_atomically
from autoprec._version import __version__
from autoprec.choice import choose, unretimed_margin
from autoprec.errors import MissingBackendError, read_stored
from autoprec.outcomes import TrialOutcome
from autoprec.search import optuna_storage, shown_storage, sqlite_file, stored_outcome
from autoprec.specs import ModeSpec
from autoprec.tune_result import TuneResult

_STYLE = {
    "accepted": {"marker": "o", "color": "tab:green"},
    "rejected": {"marker": "X", "color": "tab:red"},
    "pruned": {"marker": "s", "color": "tab:gray"},
    "failed": {"marker": "v", "color": "black"},
    "stopped": {"marker": "s", "color": "tab:gray"},
}


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise MissingBackendError(
            "Drawing a report needs matplotlib; install it with: pip install 'autoprec[report]'"
        ) from None


def plot_outcomes(
    outcomes: list[TrialOutcome], chosen: str | None, path: str | Path, title: str = ""
) -> Path:
    """Scatter samples/s against memory for every measured trial; returns the file written."""
    measured = [o for o in outcomes if o.samples_per_second and o.memory_bytes]
    if not measured:
        raise ValueError(
            f"No trial of these {len(outcomes)} has both a speed and a memory figure: nothing "
            "to draw (a run interrupted before its first trial ended has none)."
        )
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 5.5), dpi=120)
    for status, style in _STYLE.items():
        group = [o for o in measured if o.status == status]
        if group:
            axes.scatter(
                [o.memory_bytes / 2**20 for o in group],
                [o.samples_per_second for o in group],
                s=60,
                label=status,
                **style,
            )
    for outcome in measured:
        axes.annotate(
            outcome.label,
            (outcome.memory_bytes / 2**20, outcome.samples_per_second),
            textcoords="offset points",
            xytext=(6, 4),
            fontsize=7,
        )
        if outcome.label == chosen:
            axes.scatter(
                [outcome.memory_bytes / 2**20],
                [outcome.samples_per_second],
                s=400,
                marker="*",
                facecolors="gold",
                edgecolors="black",
                zorder=5,
                label=f"chosen: {chosen}",
            )
    kind = measured[0].memory_kind if measured else None
    axes.set_xlabel(
        {
            "cuda_peak": "peak CUDA memory (MiB)",
            "state_and_activations": "parameters + gradients + optimizer state + saved "
            "activations (MiB)",
        }.get(kind or "", "parameters + gradients + optimizer state (MiB)")
    )
    axes.set_ylabel("samples / s")
    axes.set_title(title or "autoprec trials: speed vs memory")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    try:
        target = _image_path(Path(path), figure.canvas.get_supported_filetypes())
        return write_atomically(target, lambda temporary: figure.savefig(temporary))
    finally:
        plt.close(figure)


def _image_path(path: Path, formats: dict[str, str]) -> Path:
    """``path``, ``.png`` added when it has no suffix (as matplotlib would add it unseen); a
    suffix matplotlib cannot write is an error naming those it can."""
    atomic_target(path)  # a folder or a device: refused as named, not renamed .png
    if not path.suffix:
        return path.with_suffix(".png")
    if path.suffix.lower().lstrip(".") not in formats:
        raise ValueError(
            f"Cannot draw the report as {str(path)!r}: matplotlib writes no {path.suffix} files. "
            f"Name a file ending in one of {', '.join('.' + f for f in sorted(formats))}."
        )
    return path


def _read_result(path: Path) -> TuneResult:
    data = read_json(path, "Trials file")
    if isinstance(data, dict) and "schema_version" in data and "spec" in data:
        raise ValueError(
            f"{str(path)!r} is a profile, not a tune run's trials. Draw the *.trials.json "
            "or the *.study.db written beside it; `autoprec show` prints a profile."
        )
    writer = _trials_writer(data)
    if writer is not None and writer != __version__:  # a trials file, of another version
        return read_stored(
            TuneResult,
            data,
            f"The trials file {str(path)!r}",
            writer=writer,
            advice="Draw it with the autoprec that wrote it.",
        )
    try:
        return TuneResult.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the top level"
        raise ValueError(
            f"{str(path)!r} is not a tune run's trials file (*.trials.json written by "
            f"`autoprec tune`): {where}: {first['msg']} ({error.error_count()} problems)."
        ) from None


def _trials_writer(data: Any) -> object:
    """The autoprec version whose profile a trials file holds (None when it holds none)."""
    profile = data.get("profile") if isinstance(data, dict) else None
    return profile.get("autoprec_version") if isinstance(profile, dict) else None


def outcomes_from_result(path: str | Path) -> tuple[list[TrialOutcome], str, int]:
    """Outcomes, the chosen label and the number of fp32 noise runs from a TuneResult JSON
    (``autoprec tune`` writes one)."""
    result = _read_result(Path(path))
    outcomes = [result.reference, *result.trials]
    return outcomes, result.chosen.label, result.budget.fp32_noise_runs


def trials_run(outcomes: list[TrialOutcome], noise_runs: int = 1) -> int:
    """Training runs behind these outcomes, counted as the profile's evidence counts them: every
    outcome that ran, plus the fp32 noise run(s) (never outcomes of their own)."""
    return sum(1 for outcome in outcomes if outcome.seconds > 0) + noise_runs


def outcomes_from_study(
    storage: str, study_name: str | None
) -> tuple[list[TrialOutcome], str, int]:
    """Outcomes from an Optuna study, its winner (chosen as tune() chose it) and the number of
    fp32 noise runs."""
    import optuna

    file = sqlite_file(storage)
    if file is not None and not file.is_file():  # opening it would create an empty database
        raise FileNotFoundError(f"{storage}: no such SQLite file ({str(file)!r}).")
    shown = shown_storage(storage)
    try:
        opened = optuna_storage(storage)
        names = optuna.get_all_study_names(storage=opened)
    except Exception as error:  # a bad URL, a missing driver, a server that does not answer
        first_line = (str(error).strip().splitlines() or [""])[0]
        found = f"{type(error).__name__}: {first_line}"
        if "://" not in storage:  # a file that is no study (a references cache, a checkpoint)
            raise ValueError(
                f"{storage!r} is not a study: neither a tune run's *.trials.json, an SQLite "
                f"study nor an Optuna journal file ({found})."
            ) from error
        raise ValueError(
            f"Cannot read the study storage {shown!r} ({found}); check the URL, its driver "
            "and that the database answers."
        ) from error
    if not names:
        raise ValueError(f"{shown} holds no study: nothing was tuned with it.")
    if study_name is None:
        if len(names) != 1:
            raise ValueError(f"{shown} holds studies {names}; pick one with --study.")
        study_name = names[0]
    elif study_name not in names:
        raise ValueError(f"{shown} holds no study {study_name!r}; it holds {names}.")
    study = optuna.load_study(study_name=study_name, storage=opened)
    trials = study.get_trials(deepcopy=False)
    foreign = trials and not any("outcome" in trial.user_attrs for trial in trials)
    if foreign and "fingerprint" not in study.user_attrs:  # it said "interrupted before ..."
        raise ValueError(
            f"The study {study_name!r} in {shown} is not an autoprec study (autoprec tune "
            f"records a fingerprint and each trial's outcome; this one holds {len(trials)} "
            f"trials without). Name a study `autoprec tune` wrote ({shown} holds {names})."
        )
    noise_runs = int(study.user_attrs.get("noise_runs", 1))
    finished = study.user_attrs.get("result")
    if finished:  # the run ended: its final figures (re-timed) and its choice
        outcomes = [stored_outcome(study, o, "its result") for o in finished["outcomes"]]
        return outcomes, str(finished["chosen"]), noise_runs
    latest = {  # an interrupted run: each candidate's last recorded outcome
        outcome.label: outcome
        for outcome in (
            stored_outcome(study, t.user_attrs["outcome"], f"trial {t.number}")
            for t in study.get_trials(deepcopy=False)
            if "outcome" in t.user_attrs
        )
    }
    outcomes = list(latest.values())
    reference = next(  # fp32, or fp32+compiled: the study's reference, as tune() runs it
        (o for o in outcomes if o.spec == ModeSpec(mode="fp32", compile=o.spec.compile)), None
    )
    if reference is None:
        return outcomes, "", noise_runs
    others = [o for o in outcomes if o is not reference]
    objective = study.user_attrs.get("objective", "speed")
    margin, _ = unretimed_margin(objective, reference, others)  # as tune() chooses
    return outcomes, choose(others, reference, objective, margin).label, noise_runs
