"""Pause Python's cyclic garbage collector while a bulk step allocates (any side).

The coordinator's first-save planning and every commit create hundreds of thousands of
small objects (tuples, dicts, index keys) next to millions of live ones (every rank's
plans and write results). Each few hundred allocations the collector runs, and its
older generations walk every live object: at 100 k items that was about two thirds of
the commit's time. None of these steps makes reference cycles, so the collector is
paused for their length and resumed after (never forced to run then).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector inside the block (or decorated call), if it was enabled.

    Usable as a decorator. Nested and concurrent uses leave it as the outermost found it;
    reference counting still frees every object that is not in a cycle.
    """
    was_enabled = gc.isenabled()
    if was_enabled:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
