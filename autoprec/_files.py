"""Atomic file writes: a crash or a full disk never leaves a half-written file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _umask() -> int:
    current = os.umask(0)  # the only portable way to read it: set, then restore
    os.umask(current)
    return current


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Let ``write`` fill a temporary file next to ``path`` (with its suffix, which some writers
    read the format from), fsync it, then rename it over ``path``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix
    )
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        with open(temporary, "rb+") as file:
            os.chmod(file.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; honour the umask
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
        text = path.read_text(encoding="utf-8")
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
