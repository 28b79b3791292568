"""The Optuna study over the candidates. Takes a runner function, so it is testable without torch.

The space is small and categorical, so it is covered exhaustively in the candidates' order: each
candidate is enqueued (``study.enqueue_trial``) and run through ask/tell, which lets the budget
wall and early stopping live outside the objective function. Objectives: samples/s
(maximize) and memory (minimize). A mode the drift gate rejects ends as a COMPLETE trial with a
violated ``drift`` constraint (``trial.set_constraint``, feasible when <= 0) and its reasons in
``user_attrs``; a trial stopped early (budget, cannot win) is PRUNED; a crash is FAIL. With a
persistent storage (SQLite, any RDB URL, a journal file) an interrupted study resumes: finished
candidates are read back, not re-run; workers sharing one study skip what another already
finished (a candidate two workers start at the same moment runs twice).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from autoprec._wording import first_names
from autoprec.errors import read_stored
from autoprec.interrupts import interrupts_deferred, raise_if_interrupted
from autoprec.outcomes import CPU_MEMORY_KINDS, OBJECTIVES, Objective, TrialOutcome, balanced_gain
from autoprec.search_events import EventSink, pace
from autoprec.specs import ModeSpec
from autoprec.trial_records import StepWindow, StopCheck, TrialProgress, measured_windows

logger = logging.getLogger(__name__)

PRUNE_MARGIN = 1 / (1 - 0.15) - 1
"""A trial is pruned when, after warm-up and 3 measured windows of steps, its step time is more
than 1.176x (1/0.85) the best accepted one's (objective speed), its samples/s below 85%. The choice
re-times every accepted mode within a wider band (``retiming.CONFIRM_WITHIN``, 30%), so every
mode the race lets through gets a second look; the race's own noise on a GPU is not measured
yet (on the first H200 run it pruned tf32 at 1.19x amp_bf16, their true ratio). 5% was the
margin first used. Measured (``benchmarks.trial_timing``, our CPU, 1 thread, 12 trials per
mode): two trials of the same mode raced this way differ by up to 1.045 (fp32), 1.025
(amp_bf16) and 1.092 (bf16_sr), and 5% pruned bf16_sr as slower than itself in 6 of 66 pairs;
on the first GPU run (H100) a mode's trial speed moved by up to 0.3 of itself between two
runs."""
MIN_MEASURED_WINDOWS = 3


Runner = Callable[[ModeSpec, StopCheck], TrialOutcome]
"""Runs one candidate; the stop check says when to give up (budget, cannot beat the best)."""


def better(
    a: TrialOutcome,
    b: TrialOutcome | None,
    objective: Objective,
    reference: TrialOutcome | None = None,
) -> bool:
    """Is accepted outcome ``a`` better than ``b`` for ``objective`` (the best so far, which
    pruning and the progress display use)? ``balanced`` scores against ``reference``."""
    if b is None:
        return True
    speed_a, speed_b = a.samples_per_second or 0.0, b.samples_per_second or 0.0
    memory_a, memory_b = a.memory_bytes or 0, b.memory_bytes or 0
    if objective == "memory":
        return (memory_a, -speed_a) < (memory_b, -speed_b)
    if objective == "balanced" and reference is not None:
        return balanced_gain(a, reference) > balanced_gain(b, reference)
    return (speed_a, -memory_a) > (speed_b, -memory_b)


def paired_step_ratio(
    theirs: Sequence[StepWindow], mine: Sequence[StepWindow]
) -> tuple[float, int] | None:
    """(median of ``mine`` / ``theirs`` window times over the windows both timed on the same
    steps, the steps compared), or None when fewer than MIN_MEASURED_WINDOWS pair up."""
    seconds = {(w.first_step, w.steps): w.seconds for w in measured_windows(theirs)}
    paired = [
        (w.seconds / seconds[(w.first_step, w.steps)], w.steps)
        for w in measured_windows(mine)
        if seconds.get((w.first_step, w.steps), 0.0) > 0
    ]
    if len(paired) < MIN_MEASURED_WINDOWS:
        return None
    return statistics.median(ratio for ratio, _ in paired), sum(steps for _, steps in paired)


def _slower_than(best: TrialOutcome, windows: Sequence[StepWindow]) -> str | None:
    """The prune reason when a trial is slower than ``best`` by more than PRUNE_MARGIN,
    compared window by window over the same steps (the same batches) when ``best`` kept its
    windows: a candidate 10% faster on every batch must not lose to a median taken over other
    batches. Without them, the medians."""
    paired = paired_step_ratio(best.windows, windows)
    if paired is not None:
        ratio, steps = paired
        if ratio > 1 + PRUNE_MARGIN:
            shown = _ratio_beyond(ratio, 1 + PRUNE_MARGIN)
            return f"slower than {best.label}: {shown}x its step time on the same {steps} steps"
        return None
    per_step = statistics.median(w.step_seconds for w in measured_windows(windows))
    if best.median_step_seconds and per_step > best.median_step_seconds * (1 + PRUNE_MARGIN):
        return (
            f"slower than {best.label}: {per_step * 1e3:.3g} vs "
            f"{best.median_step_seconds * 1e3:.3g} ms/step"
        )
    return None


def _ratio_beyond(ratio: float, cutoff: float) -> str:
    """``ratio`` with two decimals, or as many more as it takes to read above the ``cutoff``
    it passed (found by a hunt: a trial at 1.177x, pruned beyond 1/0.85 = 1.1765x, read
    "1.18x", the cut-off the docs gave)."""
    for decimals in range(2, 6):
        shown = f"{ratio:.{decimals}f}"
        if shown != f"{cutoff:.{decimals}f}":
            return shown
    return f"{ratio:.6f}"


def _pace(best: TrialOutcome | None, per_step: float) -> str:
    """What a budget stop adds when the trial was already slower than ``best`` by more than
    PRUNE_MARGIN: more budget would not make it win on speed (on a CPU without bf16 kernels the
    demo's fallback note read "6 cut by the budget" for modes at 14-21x fp32's step time, as if
    a larger budget might help). Said, not pruned as slower: one or two timed steps may hold a
    stall, and a budget stop is run again by a resumed study."""
    if best is None or not best.median_step_seconds:
        return ""
    ratio = per_step / best.median_step_seconds
    if ratio <= 1 + PRUNE_MARGIN:
        return ""
    return f", at {ratio:.3g}x {best.label}'s step time"


_PACE = re.compile(r", at [0-9.e+]+x (.+)'s step time$")


def slower_when_cut(reason: str) -> str | None:
    """The label a budget stop's reason says the trial was already slower than (:func:`_pace`
    wrote it), or None."""
    found = _PACE.search(reason)
    return None if found is None else found.group(1)


def _warmup_pace(
    progress: TrialProgress, remaining: int, left: float, best: TrialOutcome | None
) -> str | None:
    """A budget stop before any timed window, from the passes before them
    (``TrialProgress.pass_seconds``, eager runs): after one, when that pass alone took longer
    than the time left; from two on, when the remaining steps, each as slow as the fastest
    pass, would take over twice the time left (the margin of a projection from a few timed
    windows). One pass does not project the run: it may be a stall (a first step of 2.8 s for a
    10 ms one was seen on a busy machine). On a CPU an amp_fp16 trial of
    ``examples.small_convnet`` (15 s passes, fp32's step 0.11 s) ran its loss-scale pass and
    two warm-up steps unchecked and took a 60 s budget to 86 s."""
    passes = progress.pass_seconds
    if remaining <= 0 or not passes:
        return None
    fastest = min(passes)
    # the slowest step the time left affords: one pass may be a stall, so alone it counts only
    # when it outlasts all the time left
    affordable = left if len(passes) == 1 else 2 * left / remaining
    if fastest <= affordable:
        return None
    return (
        f"budget: {remaining} more steps of at least {fastest:.3g} s (its fastest pass in "
        "warm-up) would pass the deadline" + _pace(best, fastest)
    )


def make_stop_check(
    best: TrialOutcome | None,
    objective: Objective,
    deadline: float,
    clock: Callable[[], float],
    tail_seconds: float = 0.0,
) -> StopCheck:
    """Stop when the trial would pass the deadline, or provably cannot beat ``best``.
    ``tail_seconds``: what a run spends after its last step (the held-out pass and
    ``eval_fn``, as calibration measured them), projected with the steps: a 5-7 s
    ``eval_fn`` ended runs 11-22% past the budget (found by a hunt)."""

    def stop(progress: TrialProgress) -> str | None:
        measured = measured_windows(progress.windows)
        remaining = progress.steps_planned - progress.step - 1
        if not measured:  # warm-up steps (compilation, allocator growth): a floor at most
            if remaining > 0 and clock() >= deadline:
                return f"budget: the deadline passed during warm-up, {remaining} steps left"
            return _warmup_pace(progress, remaining, deadline - clock(), best)
        per_step = pace(progress)  # the figure progress shows: the timed windows' median step
        assert per_step is not None  # measured windows exist
        if remaining > 0 and clock() >= deadline:
            return f"budget: the deadline passed, {remaining} steps left"
        # projected from MIN_MEASURED_WINDOWS windows at least: one stalled first step (2.8 s
        # of a 10 ms step on a busy machine) ended the fp32 reference with "--budget too
        # small" and 117 s left (found by a hunt)
        # Fewer windows project only a run far past it (twice the time left): a very slow
        # mode still stops after its first timed step, not a whole window later.
        projected = len(measured) >= MIN_MEASURED_WINDOWS
        needed, left = remaining * per_step + tail_seconds, deadline - clock()
        if remaining > 0 and (needed > left if projected else needed > 2 * left):
            after = (
                f" with the {tail_seconds:.3g} s of held-out pass and eval_fn after them"
                if tail_seconds >= 0.1
                else ""
            )
            return (
                f"budget: {remaining} more steps of {per_step:.3g} s{after} would pass the "
                "deadline" + _pace(best, per_step)
            )
        if best is None or not projected:
            return None
        if objective == "speed" and best.median_step_seconds:
            slower = _slower_than(best, progress.windows)
            if slower is not None:
                return slower
        if (
            objective == "memory"
            and best.memory_kind in CPU_MEMORY_KINDS  # state alone bounds it from below
            and best.memory_bytes
            and progress.state_bytes is not None
            and progress.state_bytes > best.memory_bytes
        ):
            return (  # (found by a hunt: the best's figure was called "state bytes")
                f"larger than {best.label}: {progress.state_bytes:,} state bytes, more than "
                f"{best.label}'s {best.memory_bytes:,} bytes of state and saved activations"
            )
        return None

    return stop


def _values(outcome: TrialOutcome) -> list[float]:
    return [outcome.samples_per_second or 0.0, float(outcome.memory_bytes or 0)]


def record_outcome(
    study: Any, trial: Any, outcome: TrialOutcome, fingerprint: str | None = None
) -> None:
    """Tell the study how a trial ended, keeping the reasons as data, and the digest of the
    run's fingerprint it was measured under (``finished_outcomes`` reads only its own run's)."""
    import optuna

    if fingerprint is not None:
        trial.set_user_attr("fingerprint", fingerprint)
    trial.set_user_attr("outcome", outcome.model_dump_json())
    trial.set_user_attr("reasons", list(outcome.reasons))
    if outcome.status in ("accepted", "rejected"):
        trial.set_constraint(
            "drift", -1.0 if outcome.status == "accepted" else float(len(outcome.reasons) or 1)
        )
        study.tell(trial, _values(outcome))
    elif outcome.status == "pruned":
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


RESULT_LEFT_OUT = frozenset({"windows"})
"""What the study's ``result`` attribute leaves out of each outcome: its timed windows (no report
reads them; each trial's own ``outcome`` attribute keeps them). With them, an 18-mode tune of
300-step trials on a 32-layer model wrote 102 KB there (30 windows per outcome), past MySQL's
65,535-byte TEXT column that Optuna's RDB storage keeps attributes in; without them, 47 KB
(tests/test_search.py)."""


def record_result(study: Any, chosen: str, outcomes: Sequence[TrialOutcome]) -> None:
    """Keep a finished run's final figures (after side-by-side re-timing) and its choice in the
    study, so that a report drawn from the study shows what the run itself reported."""
    study.set_user_attr(
        "result",
        {
            "chosen": chosen,
            "outcomes": [o.model_dump(mode="json", exclude=set(RESULT_LEFT_OUT)) for o in outcomes],
        },
    )


def study_writer(fingerprint: Any) -> object:
    """The autoprec version a study's raw fingerprint names (None when it names none)."""
    return fingerprint.get("autoprec_version") if isinstance(fingerprint, dict) else None


STUDY_OF_ANOTHER_VERSION = (
    "Use another study name (--study NAME / study_name=) to start a new run beside it, or "
    "resume it with the autoprec that wrote it."
)


def stored_outcome(study: Any, raw: Any, which: str) -> TrialOutcome:
    """One outcome the study holds (a trial's JSON, or the result's dict), in one line's
    refusal when another autoprec wrote it with other fields."""
    return read_stored(
        TrialOutcome,
        raw,
        f"The outcome of {which} in the study {study.study_name!r}",
        writer=study_writer(study.user_attrs.get("fingerprint")),
        advice=STUDY_OF_ANOTHER_VERSION,
    )


def finished_outcomes(study: Any, fingerprint: str | None = None) -> dict[str, TrialOutcome]:
    """Outcomes already in the study (a resumed run), by label. Failed trials are re-run.
    With ``fingerprint`` (a digest), only trials measured under it, or recorded before trials
    carried one: a run with another model that took the study over while this one measured
    its references had its outcomes adopted as this run's (found by a hunt)."""
    import optuna

    done = {}
    for trial in study.get_trials(deepcopy=False):
        stamp = trial.user_attrs.get("fingerprint")
        if fingerprint is not None and stamp is not None and stamp != fingerprint:
            continue
        if trial.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
            raw = trial.user_attrs.get("outcome")
            if raw:
                outcome = stored_outcome(study, raw, f"trial {trial.number}")
                if not (
                    outcome.status == "pruned"
                    and outcome.reasons[:1]
                    and outcome.reasons[0].startswith("budget")
                ):
                    done[outcome.label] = outcome
    return done


def ask_for(study: Any, label: str, choices: Sequence[str]) -> Any:
    """A new trial of ``study`` with its candidate fixed to ``label``.

    ``ask()`` hands out the oldest enqueued trial; one left waiting by an interrupted run would
    carry another candidate, so such leftovers are closed as failed until ours comes up.
    """
    import optuna

    study.enqueue_trial({"candidate": label}, skip_if_exists=False)
    while True:
        trial = study.ask()
        if trial.suggest_categorical("candidate", list(choices)) == label:
            return trial
        trial.set_user_attr("reasons", ["left waiting by an interrupted run"])
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


SQLITE_HEADER = b"SQLite format 3\x00"
SQLITE_PREFIX = "sqlite:///"


def sqlite_url(path: str | Path) -> str:
    """The SQLAlchemy URL of an SQLite file, its path percent-quoted (a ``?`` or ``#`` in a
    file name would start the URL's query or fragment)."""
    from urllib.parse import quote

    return SQLITE_PREFIX + quote(str(path), safe="/")


def sqlite_file(storage: str) -> Path | None:
    """The file an ``sqlite:///PATH`` URL names (unquoted, its query left out), or None for
    another URL."""
    if not storage.startswith(SQLITE_PREFIX):
        return None
    from urllib.parse import unquote

    return Path(unquote(storage.removeprefix(SQLITE_PREFIX).split("?", 1)[0]))


def optuna_storage(storage: str | None) -> Any:
    """What Optuna opens for ``storage``: a URL as it is (SQLite, PostgreSQL, MySQL), None for
    memory, and a file path without ``://`` as a journal file (``JournalStorage``: Optuna's
    advice for many workers on one node); a path to an existing SQLite file as its URL."""
    if storage is None or "://" in storage:
        return storage
    path = Path(storage)
    if path.is_file():
        with path.open("rb") as file:
            if file.read(len(SQLITE_HEADER)) == SQLITE_HEADER:
                refuse_foreign_sqlite(path)
                return sqlite_url(path)
        _refuse_non_journal(path)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


class StorageRefused(ValueError):
    """A storage or study autoprec will not write to, refused before anything is written: its
    message is the whole answer (not wrapped in "cannot open the study storage")."""


def _first_line(path: Path) -> bytes:
    with path.open("rb") as file:
        return file.readline(4096).strip()


def is_journal_file(path: Path) -> bool:
    """Whether ``path`` is an Optuna journal: its first line one JSON record with an
    ``op_code`` (a tune run's trials file starts with a lone ``{``)."""
    try:
        record = json.loads(_first_line(path))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "op_code" in record


OPTUNA_TABLES = frozenset({"studies", "version_info"})
"""Tables every Optuna RDB storage has: an SQLite file with tables but not these is another
application's database."""


def refuse_foreign_sqlite(path: Path) -> None:
    """Refuse an SQLite database that holds tables but not Optuna's: Optuna created its own
    tables inside another application's database (an inventory.db gained 12; found by a hunt).
    A database that cannot be read is left to the open, which names it as damaged."""
    import contextlib
    import sqlite3

    try:
        uri = path.resolve().as_uri() + "?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as database:
            rows = database.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            tables = {str(row[0]) for row in rows}
    except sqlite3.Error:
        return
    if tables and not tables >= OPTUNA_TABLES:
        shown = first_names(sorted(tables), 6)
        raise StorageRefused(
            f"{str(path)!r} is an SQLite database of another application (its tables: "
            f"{shown}), not an Optuna study storage; nothing was written to it. Give a new file "
            "name or an existing study storage (--storage / storage=)."
        )


def _refuse_non_journal(path: Path) -> None:
    """Refuse an existing file that is neither empty nor an Optuna journal: opened as a
    journal, Optuna appended its first record to it (a user's notes.txt gained a JSON line)."""
    first = _first_line(path)
    if first and not is_journal_file(path):  # empty: a new journal
        raise StorageRefused(
            f"{str(path)!r} is neither an SQLite database nor an Optuna journal file (its first "
            f"line: {first[:60].decode(errors='replace')!r}); nothing was written to it. Give "
            "a new file name or an existing study storage (--storage / storage=)."
        )
    if first and not _ends_whole(path):
        raise StorageRefused(
            f"The journal {str(path)!r} ends in a partial record (a run stopped, or the disk "
            "filled, while it was written): Optuna would append the next record onto it and "
            "leave the file unreadable for good. Nothing was written to it. Remove the partial "
            "last line (everything after the last newline) and run again, or move the file "
            "aside."
        )


def _ends_whole(path: Path, tries: int = 5) -> bool:
    """Whether the journal ends in a newline; a worker sharing it may be writing its last
    record, so a partial one is looked at again, for up to a second."""
    for attempt in range(tries):
        with open(path, "rb") as file:
            file.seek(-1, 2)  # from the end
            if file.read(1) == b"\n":
                return True
        if attempt < tries - 1:
            time.sleep(0.25)
    return False


def shown_storage(storage: str | None) -> str:
    """``storage`` as messages show it: a URL's password replaced by ``***``
    (``postgresql://user:***@host/db``), so a refusal or a log line never prints it. The
    user name and password are split as SQLAlchemy splits them: the password runs to the
    ``@`` (a ``/`` or ``:`` in it stays hidden), the user name may hold an ``@`` (Azure's
    ``user@server``); a ``password=`` in the query string is hidden too (found by a hunt)."""
    if storage is None:
        return "memory"
    shown = re.sub(r"^([A-Za-z][\w+.-]*://[^:/]*):[^@]*@", r"\1:***@", storage)
    return re.sub(r"([?&]password=)[^&]*", r"\1***", shown, flags=re.IGNORECASE)


DEFAULT_STUDY_NAME = "autoprec"
"""The study a storage given without a study name holds (when it holds no other)."""


class StudyNameNeeded(StorageRefused):
    """A storage holds several studies and no name says which one to resume."""


def _default_study_name(names: list[str], ours: list[str], storage: str) -> str:
    """The study to resume in ``storage`` (holding the studies ``names``, of which ``ours``
    carry an autoprec fingerprint) when no name was given: :data:`DEFAULT_STUDY_NAME` when it
    is there, else the one autoprec study, else a new :data:`DEFAULT_STUDY_NAME` (a study of
    your own is never adopted). Optuna would name a new study at random on every call, so a
    run given only a storage could never resume."""
    if DEFAULT_STUDY_NAME in names or not ours:
        return DEFAULT_STUDY_NAME
    if len(ours) == 1:
        return ours[0]
    raise StudyNameNeeded(
        f"The study storage {shown_storage(storage)!r} holds {len(ours)} autoprec studies "
        f"({', '.join(ours)}) and no study name was given: pass study_name= (CLI: --study "
        "NAME) to say which to resume, or a new name to start another."
    )


@contextlib.contextmanager
def optuna_quiet() -> Iterator[None]:
    """Optuna's log at WARNING (not a line per trial) inside, the caller's level after."""
    import optuna

    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(before)


_SCHEMA_RACE = ("alembic_version", "already exists")
"""What SQLAlchemy reports when two processes create one fresh database's tables at once."""


def _retried(open_study: Callable[[], Any], attempts: int = 4) -> Any:
    """``open_study()``, tried again when another process was creating the same new
    database's tables at the same moment (two `autoprec tune` on one fresh file: one failed
    with "table studies already exists", blamed on the URL)."""
    for attempt in range(attempts - 1):
        try:
            return open_study()
        except Exception as error:
            if not any(s in str(error) for s in _SCHEMA_RACE):
                raise
            time.sleep(0.2 * (attempt + 1))
    return open_study()


_DAMAGED_SQLITE = ("malformed", "file is not a database")
"""What SQLite says of a file that starts like a database but is not a whole one."""


def create_study(storage: str | None, study_name: str | None) -> Any:
    """A two-objective study (samples/s up, memory down), new or resumed, in ``storage`` (see
    :func:`optuna_storage`). The folder of an ``sqlite:///PATH`` or journal file is created
    when missing. Without ``study_name`` a storage's study is found by
    :func:`_default_study_name`, so the same call resumes it."""

    try:
        file = None if storage is None else sqlite_file(storage)
        if file is not None and file.is_file():
            refuse_foreign_sqlite(file)
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
        return _retried(lambda: _open_study(storage, study_name))
    except StorageRefused:
        raise
    except Exception as error:
        first_line = (str(error).strip().splitlines() or [""])[0]
        check = (
            "check the URL, its driver and that the database answers"
            if storage is not None and "://" in storage and sqlite_file(storage) is None
            else "the file is not a usable SQLite database (damaged or truncated?): move it "
            "aside to start a new study, or give another storage"
            if any(sign in first_line for sign in _DAMAGED_SQLITE)
            else "another process holds the database (another tune on the same storage?): "
            "wait until it ends, or give another storage"
            if "database is locked" in first_line
            else "check the path and that its folder exists and is writable"
        )
        raise ValueError(
            f"Cannot open the study storage {shown_storage(storage)!r} ({type(error).__name__}: "
            f"{first_line}); {check}."
        ) from error


def _open_study(storage: str | None, study_name: str | None) -> Any:
    import optuna

    opened = optuna_storage(storage)
    if storage is not None and study_name is None:
        summaries = optuna.get_all_study_summaries(storage=opened, include_best_trial=False)
        names = [summary.study_name for summary in summaries]
        ours = [summary.study_name for summary in summaries if "fingerprint" in summary.user_attrs]
        study_name = _default_study_name(names, ours, storage)
    study = optuna.create_study(
        storage=opened,
        study_name=study_name,
        load_if_exists=storage is not None,
        directions=["maximize", "minimize"],
        # Every trial is enqueued with its candidate fixed, so the sampler never chooses; a
        # plain one, because BruteForceSampler calls study.stop(), which ask/tell forbids.
        sampler=optuna.samplers.RandomSampler(seed=0),
    )
    directions = [direction.name.lower() for direction in study.directions]
    if directions != ["maximize", "minimize"]:  # a study of yours: nothing written to it
        raise StorageRefused(
            f"The study {study.study_name!r} in {shown_storage(storage)} is not an autoprec "
            f"study (it optimizes {directions}; autoprec's maximize samples/s and minimize "
            "memory). Name another study (--study NAME / study_name=) to keep yours as it is."
        )
    return study


def search(
    candidates: Sequence[ModeSpec],
    runner: Runner,
    *,
    study: Any,
    objective: Objective,
    deadline: float,
    expected_trial_seconds: float,
    run_overhead_seconds: float = 0.0,
    events: EventSink | None = None,
    accepted: Sequence[TrialOutcome] = (),
    choices: Sequence[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    fingerprint: str | None = None,
    tail_seconds: Callable[[], float] = lambda: 0.0,
) -> list[TrialOutcome]:
    """Run every candidate in order until the budget runs out; returns all outcomes.

    Args:
        events: where progress goes ("start", "step", "done", "skip" per candidate).
        accepted: outcomes already known to pass (the fp32 reference), for pruning.
        choices: every label of the study's categorical "candidate" parameter (the same in
            every trial of a study; default: the candidates' labels).
        expected_trial_seconds: no new trial starts with less than half of this (its steps at
            fp32's step time: a faster mode needs less) and ``run_overhead_seconds`` left.
        run_overhead_seconds: a run's fixed cost beyond its steps (calibration's): without
            it a trial started that the budget then cut (found by a hunt: a 10 s trial with
            5 s left), pruned for the budget and re-run by a resumed study.
        fingerprint: the digest of the run's fingerprint: its trials carry it, and only
            trials that carry it are reused.
        tail_seconds: a run's held-out pass and ``eval_fn`` after its last step, reserved
            by the budget's stop check: read before each run (the slowest one yet).
    """
    import optuna

    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES} but got {objective!r}.")
    labels = [spec.label for spec in candidates]
    if len(set(labels)) != len(labels):
        raise ValueError(f"Candidates must be distinct; got {labels}.")
    choices = list(choices) if choices is not None else labels
    sink = events or EventSink(None, started=clock(), budget_seconds=0.0, clock=clock)
    previous = finished_outcomes(study, fingerprint)
    outcomes: list[TrialOutcome] = []
    best: TrialOutcome | None = None
    reference = accepted[0] if accepted else None
    for outcome in [*accepted, *previous.values()]:
        if outcome.status == "accepted" and better(outcome, best, objective, reference):
            best = outcome

    for index, spec in enumerate(candidates):
        label, total = spec.label, len(candidates)
        where = {"index": index, "total": total, "best": None if best is None else best.label}
        if index and label not in previous:  # another worker sharing the study may have run it
            previous = finished_outcomes(study, fingerprint)
        if label in previous:
            outcomes.append(previous[label])
            sink.emit("skip", label, outcome=previous[label], **where)
            continue
        if deadline - clock() < 0.5 * expected_trial_seconds + run_overhead_seconds:
            reason = (
                f"budget: {max(deadline - clock(), 0):.3g} s left, a trial takes about "
                f"{expected_trial_seconds + run_overhead_seconds:.3g} s"
            )
            outcome = TrialOutcome(spec=spec, status="pruned", reasons=(reason,))
            outcomes.append(outcome)
            sink.emit("skip", label, outcome=outcome, **where)
            continue
        trial = ask_for(study, label, choices)
        try:  # from the ask on: a Ctrl-C in the progress display counts too
            sink.emit("start", label, **where)
            check = make_stop_check(best, objective, deadline, clock, tail_seconds())
            stop = sink.watch(check, label, **where)
            outcome = runner(spec, stop)  # type: ignore[arg-type]
        except BaseException:  # Ctrl-C or a crash: leave no RUNNING trial behind, then stop
            with interrupts_deferred():  # a second Ctrl-C here left it RUNNING (a hunt)
                trial.set_user_attr("reasons", ["interrupted"])
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        with interrupts_deferred():
            record_outcome(study, trial, outcome, fingerprint)
        logger.info("%s: %s %s", label, outcome.status, "; ".join(outcome.reasons))
        if outcome.status == "accepted" and better(outcome, best, objective, reference):
            best = outcome
        outcomes.append(outcome)
        sink.emit("done", label, outcome=outcome, **{**where, "best": best and best.label})
        raise_if_interrupted()  # a Ctrl-C the garbage collector swallowed mid-trial
    return outcomes


def describe_study(study: Any) -> list[dict[str, Any]]:
    """Every trial of a study as plain data (for reports): label, state, outcome."""
    rows = []
    for trial in study.get_trials(deepcopy=False):
        raw = trial.user_attrs.get("outcome")
        rows.append(
            {
                "number": trial.number,
                "state": trial.state.name,
                "label": trial.params.get("candidate"),
                "outcome": json.loads(raw) if raw else None,
            }
        )
    return rows
