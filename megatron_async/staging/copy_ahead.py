"""Copy ahead: a warm save's staging copy starts before the save's checks (trainer).

Runs in the trainer, on the training thread of every rank; the copies themselves run on
the staging copy threads (:mod:`.copy_pool`). A warm save with an unchanged structure
spends most of its stall in Python checks that the cached plan still applies (the
structure's fingerprint, the agreement, the rebind, the budget) and then in one memory
copy. The copy does not depend on those checks when the sources are where they were:
the cached one-call copies (:class:`~.flat_copy.FlatCopy`) hold views of the memory they
read, so they can start as soon as the save begins, on the copy threads, while the
training thread runs the checks. Staging then only verifies, per bucket, that this save's
sources are that very memory (:meth:`~.flat_copy.FlatCopy.matches`) and waits for the
copy; a bucket whose sources moved waits for the copy ahead to end and is copied anew.

Safety:

* the copy ahead leases the layout's buffers like a save does, so it never writes into
  buffers an earlier save's writer still reads (it does not start then);
* only the save that started it may use it: the strategy hands it to that save's writer,
  and staging claims the lease with it (:meth:`~.buffer_cache.StagingBufferCache.lease`);
* a copy nobody claims (the save failed, planned in full, staged in rounds, or its
  request was never scheduled) is cancelled: by the strategy, by the next copy ahead, or
  when the cache drops idle buffers, or by its own staging if that did not claim it.
  Cancelling waits for every part (an interrupt meanwhile is raised afterwards), then gives
  the lease back, or drops the buffers if a copy thread is stuck past its bound.

What a user sees: staging keeps a bucket's copy ahead only if its sources are the memory
it read and no in-place operation that PyTorch tracks (the tensors' version counters)
changed them since ``async_save`` began; otherwise it copies them anew, as without the
copy ahead. Writes PyTorch does not track (through ``.data``, a numpy view, a C++
extension) between ``async_save`` and the scheduling of its request are not seen: the
checkpoint then holds those tensors' values from when ``async_save`` began. Megatron-LM
schedules the request right after ``save()`` and writes nothing in between.

Off by default, on with :data:`COPY_AHEAD_ENV` set to ``1``. It pays only where the copy
threads do not slow the training thread's checks: on our 2-CPU machine (one copy thread
beside the training thread) the staging step lost its 7-10 ms copy but the checks grew
by 3-12 ms (shared cores and memory bandwidth), and the stall's medians were not better
(docs/benchmarks.md). Worth measuring on a node with spare cores per rank and state kept
in CPU memory (``tools/bench/micro/warm_stall.py``; ``tools/ci/gpu_checks.sh`` does).

CUDA sources are not copied ahead (their copies go through page-locked buffers and one
bounded wait, :func:`~.buffers.copy_batched`).
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Hashable, Optional, Tuple

from megatron_async.core.coordination import get_rank
from megatron_async.staging.buffer_cache import StagingBufferCache
from megatron_async.staging.copy_pool import Running, copy_threads
from megatron_async.staging.flat_copy import FlatCopy

__all__ = ["CopyAhead", "AheadParts", "start_copy_ahead", "settle_parts", "COPY_AHEAD_ENV"]

logger = logging.getLogger(__name__)

COPY_AHEAD_ENV = "MEGATRON_ASYNC_STAGING_COPY_AHEAD"
"""``1`` turns the copy ahead on; off by default (see the module notes)."""


AheadParts = Tuple[FlatCopy, Running]
"""A bucket's one-call copy and the parts of it a copy ahead handed to the copy threads."""


def _no_copy_ahead() -> None:
    return None


class CopyAhead:
    """The running staging copy of one cached layout, before its save claimed it (trainer).

    The lease of the buffers is recorded by the cache (on the layout's entry, see
    :meth:`~.buffer_cache.StagingBufferCache.lease_ahead`), not here: :meth:`cancel`
    gives back what :meth:`~.buffer_cache.StagingBufferCache.detach_ahead` returns.

    Attributes:
        parts: per bucket index, the one-call copy and the parts of it handed to the copy
            threads.
        claimed: set by the cache when staging took the lease over.
    """

    def __init__(self, cache: StagingBufferCache) -> None:
        self.cache = cache
        self.parts: Dict[int, AheadParts] = {}
        self.claimed = False

    def cancel(self, stuck: bool = False) -> None:
        """End an unclaimed copy ahead: wait for every part, give the lease back (training
        thread). A claimed or already cancelled one is left alone. An interrupt while
        waiting is raised once every part ended or passed its bound.

        ``stuck``: a part that is no longer in :attr:`parts` may still write into the
        buffers (a start that failed past its bound): they are dropped, not given back.
        """
        lease = self.cache.detach_ahead(self)
        if lease is None:
            return
        interrupt = None
        try:
            settled_stuck, interrupt = settle_parts(self.take_parts())
            stuck = stuck or settled_stuck
        except BaseException:
            stuck = True
            raise
        finally:
            if stuck:  # a copy thread may still write into these buffers
                self.cache.discard(lease)
            else:
                self.cache.release(lease)
        if interrupt is not None:
            raise interrupt

    def take_parts(self) -> Dict[int, AheadParts]:
        """The parts, for whoever waits for them (once; nothing of the sources stays here)."""
        parts, self.parts = self.parts, {}
        return parts

    def __reduce__(self):
        # a writer's preload function may be pickled (a caller of another library):
        # the copy ahead is this process's and travels as None
        return (_no_copy_ahead, ())


def settle_parts(parts: Dict[int, AheadParts]) -> Tuple[bool, Optional[BaseException]]:
    """Wait for every bucket's parts whose copy is not wanted (training thread); their
    errors are dropped. Returns ``(stuck, interrupt)``: whether a part is still running
    past its bound, and the first interrupt that arrived while waiting (for the caller
    to raise once the buffers are dealt with)."""
    stuck, interrupt = False, None
    while parts:
        _, (flat, running) = parts.popitem()
        try:
            flat.settle(running)
        except BaseException as exc:  # the flat's parts ended or are stuck: go on waiting
            interrupt = interrupt if interrupt is not None or flat.stuck else exc
        stuck = stuck or flat.stuck
    return stuck, interrupt


def copy_ahead_enabled() -> bool:
    """Whether :data:`COPY_AHEAD_ENV` turns the copy ahead on (off by default)."""
    return os.environ.get(COPY_AHEAD_ENV, "0").strip() == "1"


def start_copy_ahead(cache: StagingBufferCache, key: Optional[Hashable]) -> Optional[CopyAhead]:
    """Start copying the sources of ``key``'s cached buckets, if they have one-call copies
    (every rank, training thread, before the save's checks).

    Cancels the copies ahead nobody claimed first. Returns None where nothing was started:
    no key, the copy ahead not turned on (or the copy on the training thread only,
    ``MEGATRON_ASYNC_STAGING_COPY_THREADS=1``), the layout's buffers missing or in use, or
    no bucket with a one-call copy (CUDA sources, or sources that moved at every save).

    Never fails the save, which it only speeds up: an ``Exception`` while starting is
    logged at debug level, whatever was started is cancelled (no lease or running copy is
    left behind) and the result is None; staging then copies as without it. An interrupt
    is raised once that is done.
    """
    try:
        return _start(cache, key)
    except Exception:
        logger.debug("rank %d: no copy ahead", get_rank(), exc_info=True)
        return None


def _start(cache: StagingBufferCache, key: Optional[Hashable]) -> Optional[CopyAhead]:
    """:func:`start_copy_ahead` without its guard: cancels what it started, then raises."""
    for stale in cache.unclaimed_aheads():
        stale.cancel()
    if key is None or not copy_ahead_enabled():
        return None
    threads = copy_threads() - 1  # the training thread runs the checks meanwhile
    if threads < 1:
        return None
    ahead = CopyAhead(cache)
    entry = cache.lease_ahead(key, ahead)  # from here, ahead.cancel() gives the lease back
    if entry is None:
        return None
    try:
        for index, buffers in enumerate(entry.buckets):
            flat = buffers.flat.current if buffers.flat is not None else None
            if flat is None:
                continue
            running: Running = []
            ahead.parts[index] = (flat, running)  # recorded before any part runs
            try:
                flat.start(threads, running)
            except BaseException:
                del ahead.parts[index]  # start waited for its own parts (or marked them stuck)
                raise
    except BaseException:
        ahead.cancel(stuck=any(b.flat is not None and b.flat.stuck for b in entry.buckets))
        raise
    if not ahead.parts:
        ahead.cancel()
        return None
    logger.debug("copying %d staging buckets ahead of the save's checks", len(ahead.parts))
    return ahead
