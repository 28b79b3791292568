"""One ``tune()``, ``check()`` or ``probe()`` at a time in a process.

A run seeds the global random streams (torch's, Python's, NumPy's) and puts them back, reads
whether training drew from them by comparing them before and after, holds torch's process-wide
settings and silences some warnings with ``warnings.catch_warnings`` (which saves and restores
one list every thread shares). Two runs in two threads at once mixed all of that: a paired
noise run repeated the reference (its model "drew" the other thread's numbers), and an "ignore
every warning" filter stayed in the process for good (found by a hunt). A second call waits
for the first, with a warning; a call made inside a run (from ``on_event``, or ``probe()``
inside ``tune()``) goes on. Other threads of the process should not draw from the global
random streams while a run goes on: it reseeds them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_lock = threading.RLock()
_running: list[str] = []  # what holds the lock, outermost first


@contextlib.contextmanager
def one_run_at_a_time(what: str) -> Iterator[None]:
    """Run the block while no other thread runs one; ``what`` names it in the warning."""
    if not _lock.acquire(blocking=False):
        running = _running[0] if _running else "another run"
        logger.warning(
            "%s waits for %s, running in another thread of this process: runs share the "
            "global random streams, torch's settings and the warning filters, so they run "
            "one at a time.",
            what,
            running,
        )
        _lock.acquire()
    _running.append(what)
    try:
        yield
    finally:
        _running.pop()
        _lock.release()
