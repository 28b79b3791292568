"""A Ctrl-C that a long run cannot lose.

Python turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread happens to be.
When that is a weakref callback or a ``__del__`` run by the garbage collector, Python prints
"Exception ignored in ..." and carries on: the interrupt is gone (CI caught a ``tune`` that
finished with exit code 0 after a Ctrl-C landed in SQLAlchemy's ``_collection_gced``).

``remembered_interrupts()`` installs a handler that records the press before it raises; loops
that run many trials call ``raise_if_interrupted()`` between them, so a swallowed press still
stops the run at the next trial boundary. It only replaces Python's default handler: a program
that installed its own, or ignores SIGINT, keeps its choice.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

_pressed = threading.Event()


def _remember_and_raise(signum: int, frame: FrameType | None) -> None:
    _pressed.set()
    raise KeyboardInterrupt


@contextlib.contextmanager
def remembered_interrupts() -> Iterator[None]:
    """Within the block, every Ctrl-C is remembered as well as raised (main thread only)."""
    in_main = threading.current_thread() is threading.main_thread()
    if not in_main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    _pressed.clear()
    signal.signal(signal.SIGINT, _remember_and_raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _pressed.clear()


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` when a Ctrl-C was pressed in the block and then lost."""
    if _pressed.is_set():
        raise KeyboardInterrupt
