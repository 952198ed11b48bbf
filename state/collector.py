"""Garbage collection around scheduling cycles, so that a cycle never pays for a full one.

The controller keeps its mirror and the planner's memo in memory: at 16,000 GPUs a few
hundred thousand objects that live until replaced. Left to Python's collector, the cycles'
own allocations trigger a young collection every few hundred objects and, every few
cycles, a full one that walks that whole heap (40-130 ms measured at 16,000 GPUs: the
cycle's p99). None of it finds anything: the scheduling core creates no reference cycles
(``plan.plan`` breaks the one it has), so its objects are freed by reference counting.

So a cycle runs with the collector paused, and at its end one young collection takes what
the cycle left (its database sessions may leave cycles: a millisecond or two at that
scale) and the survivors are frozen — moved where no collection walks them again. They
are still freed by reference counting when replaced. What cannot be freed that way is
garbage that forms a cycle after being frozen (a request handler that was alive at the
freeze, say); ``collect_all`` returns that, and the controller calls it every
``AdmissionCycles.full_collection_interval`` seconds, after a cycle (``hub/scheduling.py``;
the planning process does the same when the controller does).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No collection inside the block; afterwards its young garbage is collected and
    everything still alive is frozen."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect(0)
        gc.freeze()
        if enabled:
            gc.enable()


def collect_all() -> int:
    """A full collection over everything, frozen objects included, which are frozen again
    afterwards; returns the objects it freed."""
    gc.unfreeze()
    freed = gc.collect()
    gc.freeze()
    return freed
