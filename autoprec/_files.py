"""Atomic file writes: a crash or a full disk never leaves a half-written file."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _umask() -> int:
    current = os.umask(0)  # the only portable way to read it: set, then restore
    os.umask(current)
    return current


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    kinds = [(stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket")]  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def atomic_target(path: str | os.PathLike[str]) -> Path:
    """The file an atomic write to ``path`` replaces: a symbolic link's target (the link
    stays), or ``path``. Anything but a regular file there (a folder, ``/dev/null``) is refused:
    renaming a finished file over it would replace it."""
    target = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    if target.exists() and not target.is_file():
        raise ValueError(
            f"{str(path)!r} is {_kind(target)}, not a file: autoprec writes by renaming a "
            "finished file over its target and will not replace it. Give a file name."
        )
    if target.exists() and not os.access(target, os.W_OK):  # a rename needs only the folder's
        raise ValueError(
            f"{str(path)!r} is read-only: autoprec will not replace a file you cannot write "
            "(a rename would, silently; found by a hunt). Make it writable or give another path."
        )
    return target


def check_writable(path: str | os.PathLike[str]) -> Path:
    """The target of an atomic write to ``path`` (:func:`atomic_target`), after proving a file
    can be made where it goes: a probe file is created in its folder, or in the nearest folder
    that exists (nothing is left behind, no folder is made). For a long run, so that a path it
    cannot write (``/proc/p.json``, a read-only folder, a file used as a folder) is refused
    before the run, not after it."""
    target = atomic_target(path)
    folder = _nearest_folder(target.parent, path)
    try:
        handle, name = tempfile.mkstemp(dir=folder, prefix=".autoprec-write-check.")
    except OSError as error:
        raise ValueError(
            f"{str(path)!r} cannot be written: making a file in {str(folder)!r} fails "
            f"({error.strerror or type(error).__name__}). Give a path in a folder you can write."
        ) from None
    os.close(handle)
    os.unlink(name)
    return target


def _nearest_folder(folder: Path, path: str | os.PathLike[str]) -> Path:
    """``folder`` or its nearest ancestor that exists; refused when that is not a folder."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"{str(path)!r} cannot be written: {str(existing)!r} is {_kind(existing)}, not a "
            "folder. Give a path in a folder."
        )
    return existing


def _make_folder(folder: Path, path: str | os.PathLike[str]) -> None:
    _nearest_folder(folder, path)
    folder.mkdir(parents=True, exist_ok=True)


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Let ``write`` fill a temporary file next to ``path`` (with its suffix, which some writers
    read the format from), fsync it, then rename it over ``path`` (over a symbolic link's
    target, the link kept; anything but a regular file is refused: :func:`atomic_target`)."""
    target = atomic_target(path)
    _make_folder(target.parent, path)
    # an existing file keeps its permissions (a profile made private stays private)
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o666 & ~_umask()
    handle, name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix
    )
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        with open(temporary, "rb+") as file:
            os.chmod(file.fileno(), mode)  # mkstemp makes 0600
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return target


def write_text_atomically(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a temporary file next to ``path``, fsync it, then rename it over."""
    return write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def read_json(
    path: Path, what: str, *, error: type[Exception] = ValueError, advice: str = ""
) -> Any:
    """The JSON in ``path``, or ``error`` with one line naming ``what`` and what is wrong."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # an editor's byte-order mark is no error
    except FileNotFoundError:
        raise error(f"{what} {str(path)!r} does not exist.") from None
    except UnicodeDecodeError:
        with open(path, "rb") as file:
            sqlite = file.read(16) == b"SQLite format 3\x00"
        found = (
            "an SQLite database (a tune run's *.study.db? `autoprec report` draws one)"
            if sqlite
            else "binary"
        )
        raise error(f"{what} {str(path)!r} is not JSON: the file is {found}.") from None
    except OSError as problem:
        raise error(f"{what} {str(path)!r} cannot be read: {problem}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as problem:
        raise error(
            f"{what} {str(path)!r} is not valid JSON (line {problem.lineno}, column "
            f"{problem.colno}: {problem.msg}); it may be truncated.{advice}"
        ) from None
    except (ValueError, RecursionError) as problem:  # nested past Python's recursion limit,
        # an integer of more than 4300 digits (found by a hunt: tracebacks from the CLI)
        raise error(
            f"{what} {str(path)!r} is JSON autoprec cannot read ({type(problem).__name__}: "
            f"{str(problem)[:100]}).{advice}"
        ) from None
