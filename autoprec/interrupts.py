"""A Ctrl-C that a long run cannot lose.

Python turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread happens to be.
When that is a weakref callback or a ``__del__`` run by the garbage collector, Python prints
"Exception ignored in ..." and carries on: the interrupt is gone (CI caught a ``tune`` that
finished with exit code 0 after a Ctrl-C landed in SQLAlchemy's ``_collection_gced``).

``remembered_interrupts()`` installs a handler that records the press before it raises; loops
that run many trials call ``raise_if_interrupted()`` between them and between a trial's
windows of steps, so a swallowed press still stops the run at the next boundary. It only
replaces Python's default handler: a program that installed its own, or ignores SIGINT, keeps
its choice. ``tune()`` and ``check()`` take Ctrl-C so themselves; SIGTERM only the CLI.

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
def remembered_interrupts(*, terminate: bool = True) -> Iterator[None]:
    """Within the block, every Ctrl-C (and, with ``terminate``, SIGTERM) is remembered as well
    as raised (main thread only). Each signal is taken only where Python's default handling
    is in place: a shell starts a background job (``cmd &``) with SIGINT ignored, and SIGTERM
    then ended the run at once, its trial left RUNNING (found by a hunt). Nested, the inner
    block finds the outer one's handlers and leaves them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = [(signal.SIGINT, signal.default_int_handler)]
    if terminate:
        defaults.append((signal.SIGTERM, signal.SIG_DFL))
    replaced = [
        (signum, handler) for signum, handler in defaults if signal.getsignal(signum) is handler
    ]
    if not replaced:
        yield
        return
    _pressed.clear()
    for signum, _ in replaced:
        signal.signal(signum, _remember_and_raise)
    try:
        yield
    finally:
        for signum, handler in replaced:
            signal.signal(signum, handler)
        _pressed.clear()


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends (a study's record of a trial: a second Ctrl-C
    inside the cleanup of the first left the trial RUNNING; found by a hunt), then deliver
    what it held to the handlers the block found, SIGTERM first. Held by a Python handler,
    not the signal mask: Python runs handlers in the main thread whichever thread the kernel
    picks, and with torch's or the progress display's threads running a masked main thread
    got it anyway (a review). Outside the main thread the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    previous = {signum: handler for signum, handler in previous.items() if handler is not None}
    for signum in previous:  # None: a handler not set from Python, left as it is
        signal.signal(signum, lambda number, _frame: held.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        # to the handlers in place before the block, SIGTERM first: a Ctrl-C ignored there (a
        # background job) must not drop a SIGTERM held after it (a review)
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signum in held:
                signal.raise_signal(signum)


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` (``Terminated`` for a SIGTERM) when one came in the block
    and was then lost."""
    if _pressed.is_set():
        raise _raised[0]
