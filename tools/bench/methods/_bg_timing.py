"""Timestamps of a background write, recorded where the write runs.

Kept free of heavy imports: the persistent worker unpickles :func:`timed_call` and so
imports this module. ``time.monotonic`` is CLOCK_MONOTONIC on Linux, one clock for every
process of the machine, so the trainer can compare these stamps with its own.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, Optional

__all__ = ["timed_call", "read_stamps"]


def timed_call(stamp_path: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` and write its start and end time to ``stamp_path`` (background side)."""
    start = time.monotonic()
    try:
        return fn(*args, **kwargs)
    finally:
        end = time.monotonic()
        tmp = f"{stamp_path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"start": start, "end": end, "pid": os.getpid()}, f)
        os.replace(tmp, stamp_path)


def read_stamps(stamp_path: str) -> Optional[Dict[str, float]]:
    """Return the stamps :func:`timed_call` wrote, or None when there are none."""
    try:
        with open(stamp_path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
