"""The trainer's reusable staging buffers: one bucket layout's buffers, lent to one save at a time.

Runs in the trainer (every rank has its own caches). :func:`~.buffers.stage_buckets`
leases a layout's buffers for one save; the caller that ran the staging releases the
lease once the background part no longer reads them. Every lease has its own generation
number, so only the save holding the current lease can make the buffers reusable.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
from typing import Any, Hashable, List, Optional, Tuple

from megatron_async.core.device_wait import release_landed
from megatron_async.core.one_per_process import OnePerProcess

__all__ = ["StagingBufferCache"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _BufferSet:
    """The cached buffers of one bucket layout and the state of their lease."""

    buckets: List[Any]
    """One bucket's buffers per bucket of the layout (None until first staged)."""
    leased: bool = False
    owner_pid: int = 0
    generation: int = 0

    def num_bytes(self) -> int:
        return sum(b.num_bytes() for b in self.buckets if b is not None)


class StagingBufferCache(OnePerProcess):
    """Reusable staging buffers, one bucket layout at a time, each lent to one save at a time.

    Lives in the trainer process that stages (every rank has its own). An owner (a
    strategy, a writer) passes it explicitly to
    :func:`~megatron_async.staging.buffers.stage_buckets`; writers built
    without one share the process's (:meth:`of_process`). A new layout replaces the others
    (a changed structure does not leave a checkpoint's worth of shared memory behind);
    buffers still leased are dropped when their lease ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: "collections.OrderedDict[Hashable, _BufferSet]" = collections.OrderedDict()
        self._generations = itertools.count(1)  # a lease on a dropped and re-created entry never matches

    def lease(self, key: Hashable, num_buckets: int) -> Optional[_BufferSet]:
        """Return ``key``'s buffer set, leased to the caller, or None if it is leased already."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = _BufferSet([None] * num_buckets)
                for other in [k for k, e in self._entries.items() if not e.leased]:
                    del self._entries[other]
                self._entries[key] = entry
            elif entry.leased:
                logger.debug("staging buffers of this layout are still being written; using new ones")
                return None
            self._entries.move_to_end(key)  # the latest layout
            entry.leased, entry.owner_pid = True, os.getpid()
            entry.generation = next(self._generations)
            return entry

    def release(self, lease: Optional[Tuple[Hashable, int]], reusable: bool = True) -> None:
        """Make the leased buffers reusable once nothing reads them any more (stager).

        A lease that is no longer current (its buffers were freed and leased again by a
        later save), or one taken in another process, releases nothing. ``reusable``
        False forgets the buffers for good: something may still write into them (a stuck
        copy thread), so no later save may lease them; their memory is freed once the
        last reference to it goes.
        """
        if lease is None:
            return
        key, generation = lease
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.generation != generation or entry.owner_pid != os.getpid():
                return
            entry.leased = False
            if not reusable or next(reversed(self._entries)) != key:
                del self._entries[key]  # stuck, or a newer layout replaced it while it was written

    def num_bytes(self) -> int:
        """Bytes held by the cached buffers."""
        with self._lock:
            return sum(entry.num_bytes() for entry in self._entries.values())

    def clear(self, include_in_use: bool = False) -> None:
        """Drop the cached buffers that are not in use (or all of them), and the host memory
        kept for device copies that have landed since a failed wait.

        ``include_in_use`` also forgets leased buffers (whose data stays valid for whoever
        holds it); use it only when no save is in flight, e.g. in tests.
        """
        with self._lock:
            for key in [k for k, e in self._entries.items() if include_in_use or not e.leased]:
                del self._entries[key]
        release_landed()

