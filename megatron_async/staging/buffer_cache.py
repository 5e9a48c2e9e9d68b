"""The trainer's reusable staging buffers: the latest bucket layout's, lent to one save at a time.

Runs in the trainer (every rank has its own caches). :func:`~.buffers.stage_buckets`
borrows a layout's buffers for the staged data of one save under that save's
:class:`~.budget.Loan` (the one the budget's ledger counts), so they are lent again only
once its writer is done with them or the caller released them. Each save has its own
loan, so a release of an older save never frees a later save's buffers.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Hashable, List, Optional, Tuple

from megatron_async.core.device_wait import release_landed
from megatron_async.core.one_per_process import OnePerProcess
from megatron_async.staging.budget import Loan

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
        self._loan: Optional[Loan] = None

    def lend(self, key: Hashable, num_buckets: int) -> Tuple[Optional[List[Any]], Loan]:
        """Lend ``key``'s buffers (one entry per bucket, None until first staged) and the
        loan that ends the borrowing; no buffers (None) while an earlier save's loan of this
        layout is not over."""
        loan = Loan()
        with self._lock:
            if key != self._key:
                self._key, self._buckets = key, []
            elif self._loan is not None and not self._loan.over():
                logger.debug("staging buffers of this layout are still being read; using new ones")
                return None, loan
            self._buckets.extend([None] * (num_buckets - len(self._buckets)))
            self._loan = loan
            return self._buckets, loan

    def forget(self, loan: Loan) -> None:
        """Drop the buffers lent under ``loan`` for good: something may still write into
        them (a stuck copy thread or device copy); they are freed with their last reference."""
        with self._lock:
            if self._loan is loan:
                self._key, self._buckets, self._loan = None, [], None

    def num_bytes(self) -> int:
        """Bytes held by the cached buffers."""
        with self._lock:
            return sum(b.num_bytes() for b in self._buckets if b is not None)

    def clear(self) -> None:
        """Drop the cached buffers unless a save has them, and the host memory kept for
        device copies that have landed since a failed wait."""
        with self._lock:
            if self._loan is None or self._loan.over():
                self._key, self._buckets, self._loan = None, [], None
        release_landed()
