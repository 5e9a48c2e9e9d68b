"""Pause Python's cyclic garbage collector while a bulk step allocates (any side).

The coordinator's gathers of every rank's plans and write results (unpickling), its
first-save planning and every commit create hundreds of thousands of small objects (tuples, dicts, index keys) next to millions of live ones (every rank's
plans and write results). Each few hundred allocations the collector runs, and its
older generations walk every live object: at 100 k items that was about two thirds of
the commit's time. None of these steps makes reference cycles, so the collector is
paused for their length and resumed after (never forced to run then).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

__all__ = ["paused_gc"]

# A per-process fact with no owner: the collector is one per interpreter, so its pause is
# shared by every thread and save of the process.
_lock = threading.Lock()
_depth = 0
_resume = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector inside the block (or decorated call), if it was enabled.

    Usable as a decorator. Nested uses, and uses by several threads at once (the
    background writer thread of a persistent worker beside a commit), share one pause: the
    first to enter disables the collector if it was enabled, the last to leave enables it
    again. Reference counting still frees every object that is not in a cycle.
    """
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            if _resume:
                gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
