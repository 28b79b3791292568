"""Python's garbage collector while tune() or check() run: the caller's objects are kept out of
its full collections, and given back when the run ends.

A full collection walks every tracked object of the process, and a run makes enough objects
(model copies, optimizers, records) to start several. In a process that holds many objects (a
notebook with a dataset read into Python lists, a test suite) each walk takes the run's time:
measured with ``python -m benchmarks.gc_pauses`` (tiny_gpt, a 0.25-minute budget, 1.5 million
objects held beside it, our 2-core CPU), 8 full collections took 3.59 s of the 15 s budget;
with the caller's objects frozen, 8 took 0.02 s. A pause that lands in a trial's timed window
also makes that mode look slower than it is, and one near the deadline carries the run past
it (test_budget_is_a_hard_wall ended at 15.8 s of 15 inside the test suite's process). What
autoprec itself imports on first use (optuna, the backends) is made after the freeze and still
walked: about 0.1 s a collection here.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def callers_objects_frozen() -> Iterator[None]:
    """Run a block with every object alive at its start frozen out of the collector's walks
    (``gc.freeze``), unfrozen when it ends, however it ends. Garbage made inside is collected
    as usual. A caller whose collector is off, or who froze objects of their own, is left as
    they set it: unfreezing at the end would unfreeze theirs too."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
