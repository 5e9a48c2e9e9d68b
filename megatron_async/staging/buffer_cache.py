"""The trainer's reusable staging buffers: the latest bucket layout's, lent to one save at a time.

Runs in the trainer (every rank has its own caches). :func:`~.buffers.stage_buckets`
borrows a layout's buffers for the staged data of one save, which holds them until it is
released (its writer read everything, or the caller gave it back) or gone: the staged
data itself is the loan, so a release of an older save never frees a later save's buffers.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Hashable, List, Optional

from megatron_async.core.device_wait import release_landed
from megatron_async.core.one_per_process import OnePerProcess

__all__ = ["StagingBufferCache"]

logger = logging.getLogger(__name__)


class StagingBufferCache(OnePerProcess):
    """Reusable staging buffers of one bucket layout, lent to one save at a time.

    Lives in the trainer process that stages (every rank has its own). An owner (a
    strategy, a writer) passes it explicitly to
    :func:`~megatron_async.staging.buffers.stage_buckets`; writers built
    without one share the process's (:meth:`of_process`). A new layout replaces the cached
    one (a changed structure does not leave a checkpoint's worth of shared memory behind);
    a save still reading the old buffers keeps them until it is released.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: Optional[Hashable] = None
        self._buckets: List[Any] = []
        self._borrower: Optional[weakref.ref] = None

    def lend(self, key: Hashable, num_buckets: int, borrower: Any) -> Optional[List[Any]]:
        """Lend ``key``'s buffers to ``borrower`` (staged data with ``buffers_released``):
        one entry per bucket, None until first staged. None while another save has them."""
        with self._lock:
            if key != self._key:
                self._key, self._buckets = key, []
            elif self._lent():
                logger.debug("staging buffers of this layout are still being written; using new ones")
                return None
            self._buckets.extend([None] * (num_buckets - len(self._buckets)))
            self._borrower = weakref.ref(borrower)
            return self._buckets

    def _lent(self) -> bool:
        borrower = self._borrower() if self._borrower is not None else None
        return borrower is not None and not borrower.buffers_released

    def forget(self, borrower: Any) -> None:
        """Drop the buffers lent to ``borrower`` for good: something may still write into
        them (a stuck copy thread or device copy); they are freed with their last reference."""
        with self._lock:
            if self._borrower is not None and self._borrower() is borrower:
                self._key, self._buckets, self._borrower = None, [], None

    def num_bytes(self) -> int:
        """Bytes held by the cached buffers."""
        with self._lock:
            return sum(b.num_bytes() for b in self._buckets if b is not None)

    def clear(self, include_in_use: bool = False) -> None:
        """Drop the cached buffers unless a save has them (or whatever, with
        ``include_in_use``), and the host memory kept for device copies that have landed
        since a failed wait.

        ``include_in_use`` also forgets lent buffers (whose data stays valid for whoever
        holds it); use it only when no save is in flight, e.g. in tests.
        """
        with self._lock:
            if include_in_use or not self._lent():
                self._key, self._buckets, self._borrower = None, [], None
        release_landed()
