"""The staging memory budget, and the staging memory kept from one save to the next.

Runs in the trainer (every rank), in the request's ``preload_fn``. Every save staged by
:class:`~megatron_async.writer.filesystem.FileSystemWriterAsync` (through
:class:`~.stager.BucketStager`) or by ``TorchAsyncCheckpoint`` (:mod:`.torch_save`)
stays within it:

* the budget is ``staging_memory_limit`` (bytes, or a fraction of the node's memory
  shared by its local ranks, :func:`resolve_budget`); without one it is *one copy of the
  state*, today's steady state;
* the process keeps a :class:`StagingLedger` of the staging memory that saves still being
  written hold. A save first waits (bounded) until the ledger has room for it: a second
  save scheduled while the first is written waits for the first's writer to finish
  (logged) instead of allocating a second copy, unless the budget holds two copies;
* a state larger than the budget goes in rounds through the ledger's *pool*, one shared
  segment of the budget's size reused save after save; a state within it is staged into
  its bucket layout's buffers, which a :class:`StagingBufferCache` keeps for the layout's
  next save.

Each save's memory is one :class:`Loan`, which ends when the save's writer marks its gate
done (it read everything) or is gone, or when the caller releases the staged data. The
cache lends a layout's buffers to one save at a time, under that save's loan, so they are
lent again only once it ended; a release of an older save never frees a later save's
buffers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Hashable, List, Optional, Tuple

import torch

from megatron_async.core import shared_memory
from megatron_async.core.coordination import local_world_size
from megatron_async.core.device_wait import release_landed
from megatron_async.core.one_per_process import OnePerProcess
from megatron_async.errors import CheckpointValidationError, StagingMemoryError
from megatron_async.staging.overlapped import CopyThread, StagedData
from megatron_async.core.config import STAGING_WAIT_S
from megatron_async.staging.gate import StagingGate

__all__ = ["Loan", "StagingBufferCache", "StagingLedger", "resolve_budget",
           "validate_staging_memory_limit"]

logger = logging.getLogger(__name__)


def validate_staging_memory_limit(limit: Any) -> None:
    """Refuse a limit that is neither None, a positive int of bytes, nor a fraction in (0, 1].

    Raises:
        CheckpointValidationError: saying what to pass instead.
    """
    if limit is None:
        return
    ok = (
        isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
    ) or (isinstance(limit, float) and 0.0 < limit <= 1.0)
    if not ok:
        raise CheckpointValidationError(
            f"staging_memory_limit must be a positive number of bytes per rank (int), a "
            f"fraction in (0, 1] of the node's memory shared by its local ranks (float), or "
            f"None for one copy of the state; got {limit!r}"
        )


def resolve_budget(limit: Any, state_bytes: int) -> int:
    """This rank's budget in bytes for a state of ``state_bytes`` (trainer).

    None: one copy of the state. A float: that fraction of the node's memory, divided
    among ``LOCAL_WORLD_SIZE`` ranks (torchrun sets it; 1 without it).
    """
    if limit is None:
        return max(state_bytes, 1)
    if isinstance(limit, float):
        node_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return max(int(node_bytes * limit) // local_world_size(), 1)
    return int(limit)


class Loan:
    """One save's staging memory, in use until the caller releases the staged data or the
    save's gate says its writer is done reading or gone (trainer).

    The ledger counts ``num_bytes`` of it against the budget, and the buffer cache lends
    its buffers under it (:class:`StagingBufferCache`). Dropping the staged data does not end it:
    megatron-core 0.16's own queue drops the data while the writer it forked still reads
    it. A writer that dies before it recorded its process holds it until the caller's
    release, or until the next save's wait for room gives up (bounded).
    """

    __slots__ = ("num_bytes", "gate", "released", "staged")

    def __init__(self) -> None:
        self.num_bytes = 0
        self.gate: Optional[StagingGate] = None
        self.released = False
        self.staged: Optional[weakref.ref] = None

    def end(self) -> None:
        """Stop holding, and let go of the gate at once: a finished save must not
        keep a shared-memory segment alive until the next save prunes the ledger."""
        self.released = True
        self.gate = self.staged = None

    def over(self) -> bool:
        """Whether the loan ended; ending it here once the writer is done or gone, when the
        staged data (if still referenced: a caller that releases it only at finalization)
        gives its own buffers back at once."""
        gate = self.gate
        if not self.released and gate is not None and (gate.writer_done or gate.writer_gone()):
            staged = self.staged() if self.staged is not None else None
            self.end()
            if staged is not None:
                staged.release()
        return self.released


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


class StagingLedger(OnePerProcess):
    """The staging memory held by this process's saves, and the pool they share (trainer).

    The budget is per rank, shared by every save of the process (torch_dist and
    ``torch.save`` alike), so there is one ledger per process: :meth:`of_process`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loans: List[Loan] = []
        self._pool: Optional[Tuple[torch.Tensor, bool]] = None
        self.peak_bytes = 0

    def held_bytes(self) -> int:
        with self._lock:
            self._loans = [loan for loan in self._loans if not loan.over()]
            return sum(loan.num_bytes for loan in self._loans)

    def stage_within(
        self, stage: Callable[[Optional[torch.Tensor]], Any], *, state_bytes: int, budget: int,
        in_rounds: bool, gate: StagingGate, pinned: bool, timeout_s: float,
    ) -> Any:
        """Run one save's ``stage`` within ``budget`` and return what it staged (trainer,
        ``preload_fn``).

        Waits (bounded) until the save's memory fits (``state_bytes``; in rounds, the
        whole budget), calls ``stage(pool)`` (in rounds the pool, page-locked if
        ``pinned``; otherwise None) and holds the memory under the staged data's
        :class:`Loan` (a new one if it has none) until the save's writer is done with it
        or the caller releases it; a failed ``stage`` holds nothing.

        Raises:
            StagingMemoryError: earlier saves did not free the memory or the pool within
                ``timeout_s``; and whatever ``stage`` raises.
        """
        num_bytes = budget if in_rounds else state_bytes
        held = self._wait_for_room(num_bytes, budget, timeout_s)
        staged = stage(self.pool(budget, pinned, timeout_s) if in_rounds else None)
        ours = isinstance(staged, StagedData)  # an override's: only the writer's mark ends it
        loan = staged.loan if ours and staged.loan is not None else Loan()  # cached buffers'
        if ours:
            staged.loan, loan.staged = loan, weakref.ref(staged)
        loan.num_bytes, loan.gate = num_bytes, gate
        with self._lock:
            self._loans.append(loan)
            self.peak_bytes = max(self.peak_bytes, held + num_bytes)
        return staged

    def _wait_for_room(self, num_bytes: int, budget: int, timeout_s: float) -> int:
        """Wait until ``num_bytes`` more fit in ``budget``; return the bytes held then.

        Raises:
            StagingMemoryError: the earlier saves did not free enough within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        held = self.held_bytes()
        if held and held + num_bytes > budget:
            logger.info(
                "staging memory: %d bytes still held by a save being written; this save needs "
                "%d within a budget of %d bytes, so it waits for that write (at most %.0fs)",
                held, num_bytes, budget, timeout_s,
            )
        pause = 0.001
        while held and held + num_bytes > budget:
            if time.monotonic() > deadline:
                raise StagingMemoryError(
                    f"this save needs {num_bytes} bytes of staging memory and an earlier save "
                    f"still holds {held} of the {budget}-byte staging_memory_limit after "
                    f"{timeout_s:.0f}s; its writer is slow or stuck. Save less often, raise "
                    "staging_memory_limit (--ckpt-staging-memory-limit), or check the writer"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            held = self.held_bytes()
        return held

    def pool(self, num_bytes: int, pinned: bool, timeout_s: float = STAGING_WAIT_S) -> torch.Tensor:
        """A shared segment of ``num_bytes`` for staging in rounds, reused save after save,
        once no earlier save's copy job writes into it (bounded by ``timeout_s``: its
        writer may be done, or failed, while its copy job still runs).

        Raises:
            StagingMemoryError: an earlier save's copy made no progress for ``timeout_s``.
        """
        if CopyThread.of_process().stalled(timeout_s) is not None:
            raise StagingMemoryError(
                f"an earlier save's copy into the staging pool made no progress for "
                f"{timeout_s:.0f}s, so the pool cannot be reused; its writer is stuck"
            )
        with self._lock:
            if self._pool is not None and self._pool[0].numel() == num_bytes and (
                self._pool[1] or not pinned
            ):
                return self._pool[0]
            self._pool = None
        segment = shared_memory.allocate_segment(num_bytes, reusable=True)
        if pinned:
            shared_memory.pin_segment(segment)
        with self._lock:
            self._pool = (segment, pinned)
        return segment

    def drop_pool(self) -> None:
        """Forget the pool (freed once the last save using it is released)."""
        self.held_bytes()  # forgets the finished saves, and their views of the pool
        with self._lock:
            self._pool = None

