"""Atomic file writes: a crash or a full disk never leaves a half-written file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    current = os.umask(0)  # the only portable way to read it: set, then restore
    os.umask(current)
    return current


def write_text_atomically(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a temporary file next to ``path``, fsync it, then rename it over."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.chmod(file.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; honour the umask
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target
