"""A Ctrl-C that a long run cannot lose.

Python turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread happens to be.
When that is a weakref callback or a ``__del__`` run by the garbage collector, Python prints
"Exception ignored in ..." and carries on: the interrupt is gone (CI caught a ``tune`` that
finished with exit code 0 after a Ctrl-C landed in SQLAlchemy's ``_collection_gced``).

``remembered_interrupts()`` installs a handler that records the press before it raises; loops
that run many trials call ``raise_if_interrupted()`` between them, so a swallowed press still
stops the run at the next trial boundary. It only replaces Python's default handler: a program
that installed its own, or ignores SIGINT, keeps its choice.

SIGTERM (what ``timeout``, Slurm and ``docker stop`` send) is raised the same way, as
:class:`Terminated`, where its default action (end the process at once) was in place: it had
left the trial it hit RUNNING in the study for good, and printed nothing (found by a hunt).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

_pressed = threading.Event()
_raised: list[type[KeyboardInterrupt]] = [KeyboardInterrupt]


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised as an interrupt so the run stops as it stops for a Ctrl-C."""


def _remember_and_raise(signum: int, frame: FrameType | None) -> None:
    _raised[0] = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    _pressed.set()
    raise _raised[0]


@contextlib.contextmanager
def remembered_interrupts() -> Iterator[None]:
    """Within the block, every Ctrl-C is remembered as well as raised (main thread only)."""
    in_main = threading.current_thread() is threading.main_thread()
    if not in_main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    _pressed.clear()
    terminate = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signal.signal(signal.SIGINT, _remember_and_raise)
    if terminate:
        signal.signal(signal.SIGTERM, _remember_and_raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if terminate:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _pressed.clear()


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` (``Terminated`` for a SIGTERM) when one came in the block
    and was then lost."""
    if _pressed.is_set():
        raise _raised[0]
