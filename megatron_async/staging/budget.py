"""The staging memory budget: how much host memory one rank's saves may hold at once.

Runs in the trainer (every rank), in the request's ``preload_fn``. Every save staged by
:class:`~megatron_async.writer.filesystem.FileSystemWriterAsync` goes through
:func:`stage_within_budget`:

* the budget is ``staging_memory_limit`` (bytes, or a fraction of the node's memory
  shared by its local ranks, :func:`resolve_budget`); without one it is *one copy of the
  state*, today's steady state;
* the process keeps a :class:`StagingLedger` of the staging memory that saves still being
  written hold. A save first waits (bounded) until the ledger has room for it: a second
  save scheduled while the first is written waits for the first's writer to finish
  (logged) instead of allocating a second copy, unless the budget holds two copies;
* a state that fits the budget is staged in one go (:func:`~.buffers.stage_buckets`,
  unchanged); a larger one in rounds through a pool of the budget's size
  (:mod:`megatron_async.staging.rounds`; with overlapped staging every round is copied
  by the copy thread, :mod:`megatron_async.staging.overlapped`); a single tensor
  larger than the budget is refused before anything is staged or lost
  (:class:`~megatron_async.errors.StagingMemoryError` naming the tensor and the budget
  it needs).

A hold ends when the save's writer marks its gate done (it read everything)
or when the caller releases the staged data, whichever comes first.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
import weakref
from functools import partial
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from megatron_async.core import shared_memory
from megatron_async.core.coordination import local_world_size
from megatron_async.core.hand_over import require_hand_over
from megatron_async.errors import CheckpointValidationError, StagingMemoryError
from megatron_async.staging.buffers import StagingBufferCache, default_staging_cache
from megatron_async.staging.copy_job import stalled_copy
from megatron_async.staging.rounds import check_fits, stage_in_rounds
from megatron_async.staging.gate import StagingGate
from megatron_async.buckets.layout import WriteBucket

__all__ = [
    "StagingLedger",
    "staging_ledger",
    "validate_staging_memory_limit",
    "resolve_budget",
    "stage_within_budget",
    "budgeted_preload",
    "DEFAULT_STAGING_MEMORY_WAIT_S",
]

logger = logging.getLogger(__name__)

DEFAULT_STAGING_MEMORY_WAIT_S = 600.0
"""Bound on a save's wait for staging memory held by an earlier save, and on each wait
for the writer while staging in rounds."""


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


def _node_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - every Linux has both
        return 0


def resolve_budget(limit: Any, state_bytes: int) -> int:
    """This rank's budget in bytes for a state of ``state_bytes`` (trainer).

    None: one copy of the state. A float: that fraction of the node's memory, divided
    among ``LOCAL_WORLD_SIZE`` ranks (torchrun sets it; 1 without it).
    """
    if limit is None:
        return max(state_bytes, 1)
    if isinstance(limit, float):
        return max(int(_node_memory_bytes() * limit) // local_world_size(), 1)
    return int(limit)


class _Hold:
    """Staging memory held by one save until its writer is done, the caller releases the
    staged data, or nothing in this process references that data any more."""

    def __init__(self, num_bytes: int, gate: StagingGate):
        self.num_bytes = num_bytes
        self.gate: Optional[StagingGate] = gate
        self.released = False
        self.staged: Optional[weakref.ref] = None

    def end(self) -> None:
        """Stop holding, and let go of the gate at once: a finished save must not
        keep a shared-memory segment alive until the next save prunes the ledger (a live
        segment makes a restarted persistent worker start as a fresh interpreter)."""
        self.released = True
        self.gate = None

    def done(self) -> bool:
        if self.released:
            return True
        staged = self.staged() if self.staged is not None else None
        if self.staged is not None and staged is None:
            self.end()  # dropped without a release: its buffers are gone
        elif self.gate is not None and (self.gate.writer_done or self.gate.writer_gone()):
            # Done reading, or its process ended without saying so (killed before it read).
            self.end()
            release = getattr(staged, "release", None)
            if release is not None:
                release()  # the writer read everything: reusable now
        return self.released


class StagingLedger:
    """The staging memory held by this process's saves, and the pool they share (trainer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: List[_Hold] = []
        self._pool: Optional[Tuple[torch.Tensor, bool]] = None
        self.peak_bytes = 0

    def held_bytes(self) -> int:
        with self._lock:
            self._holds = [h for h in self._holds if not h.done()]
            return sum(h.num_bytes for h in self._holds)

    def reserve(self, num_bytes: int, budget: int, gate: StagingGate, timeout_s: float) -> _Hold:
        """Wait until ``num_bytes`` more fit in ``budget``, then hold them (bounded).

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
        hold = _Hold(num_bytes, gate)
        with self._lock:
            self._holds.append(hold)
            self.peak_bytes = max(self.peak_bytes, held + num_bytes)
        return hold

    def _wait_for_pool_writers(self, timeout_s: float) -> None:
        """Wait (bounded) until no earlier save's copy can still write into the pool: its
        writer may be done (failed) while its copy job still runs."""
        if stalled_copy(timeout_s) is not None:
            raise StagingMemoryError(
                f"an earlier save's copy into the staging pool made no progress for "
                f"{timeout_s:.0f}s, so the pool cannot be reused; its writer is stuck"
            )

    def pool(self, num_bytes: int, pinned: bool, timeout_s: float = DEFAULT_STAGING_MEMORY_WAIT_S) -> torch.Tensor:
        """A shared segment of ``num_bytes`` for staging in rounds, reused save after save,
        once no earlier save's copy job writes into it (bounded by ``timeout_s``)."""
        self._wait_for_pool_writers(timeout_s)
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


_ledger = StagingLedger()


def staging_ledger() -> StagingLedger:
    """This process's ledger (one per trainer process)."""
    return _ledger


_SECOND = operator.itemgetter(1)
_NBYTES = operator.attrgetter("nbytes")
_IS_CUDA = operator.attrgetter("is_cuda")


def _state_sizes(buckets: Sequence[WriteBucket]) -> Tuple[int, bool]:
    """The bytes of the buckets' tensors and whether any is on CUDA (``map``: every save
    of thousands of tensors runs this on the training thread)."""
    total, cuda = 0, False
    for bucket in buckets:
        tensors = list(map(_SECOND, bucket.data[1]))
        total += sum(map(_NBYTES, tensors))
        cuda = cuda or any(map(_IS_CUDA, tensors))
    return total, cuda


def _mark(staged: Any, hold: _Hold, stats: dict, rounds: int, peak: int) -> None:
    """Tie the hold to the staged data: the caller's release ends it too (a killed writer
    never marks its gate done), and so does dropping the data unreleased."""
    stats.update(rounds=rounds, peak_bytes=peak)
    try:
        staged_ref = weakref.ref(staged)
    except TypeError:  # staged data without weak references: the writer's mark ends it
        return
    hold.staged = staged_ref
    release = getattr(type(staged), "release", None)

    def release_and_end_hold() -> None:  # holds no strong reference: no cycle to collect
        hold.end()
        target = staged_ref()
        if release is not None and target is not None:
            release(target)

    def record_writer(pid: int) -> None:  # the caller, at the hand-over
        if hold.gate is not None:
            hold.gate.record_writer(pid)

    staged.release = release_and_end_hold
    staged.record_writer = record_writer


def stage_within_budget(
    gate: StagingGate,
    buckets: Sequence[WriteBucket],
    limit: Any,
    cache: Optional[StagingBufferCache],
    timeout_s: float,
    stage_one_go: Callable[[], Any],
    overlapped: Optional[Callable[..., Any]],
    stats: dict,
    rounds: bool = True,
) -> Any:
    """Stage ``buckets`` within the budget (trainer, the request's ``preload_fn``).

    ``stage_one_go`` is the writer's own staging (one go, or overlapped), used when the
    state fits; ``overlapped`` (None without overlapped staging) stages in rounds in place
    of :func:`~.rounds.stage_in_rounds`, with the same arguments
    (:func:`~.overlapped.stage_in_rounds_overlapped` with the rank bound);
    ``stats`` receives ``rounds`` and ``peak_bytes`` of this save.

    Raises:
        StagingMemoryError: a single tensor exceeds the budget, earlier saves did not
            free the memory in time, or the write path cannot take items in rounds;
            nothing was staged.
        StagingHandOverError: the state needs rounds but another library's caller runs
            this ``preload_fn`` (it would never start the later rounds' copy).
    """
    state_bytes, cuda = _state_sizes(buckets)
    budget = resolve_budget(limit, state_bytes)
    if state_bytes <= budget:
        hold = _ledger.reserve(state_bytes, budget, gate, timeout_s)
        try:
            staged = stage_one_go()
        except BaseException:
            hold.end()
            raise
        _mark(staged, hold, stats, 1, state_bytes)
        return staged
    if not rounds:
        raise StagingMemoryError(
            f"this rank's state ({state_bytes} bytes) is larger than the staging_memory_limit "
            f"({budget} bytes); this writer's write path (an override without "
            "staging_control) cannot take items in rounds. Accept staging_control in the "
            "override, or raise staging_memory_limit to at least the state"
        )
    check_fits(buckets, budget)
    require_hand_over(
        f"staging this rank's state ({state_bytes} bytes) in rounds through the "
        f"staging_memory_limit ({budget} bytes)",
        f"set staging_memory_limit to at least {state_bytes} bytes (one copy of the state)",
    )
    (cache if cache is not None else default_staging_cache()).clear()  # idle one-go buffers
    hold = _ledger.reserve(budget, budget, gate, timeout_s)
    try:
        pool = _ledger.pool(budget, pinned=cuda, timeout_s=timeout_s)
        staged = (overlapped or stage_in_rounds)(buckets, pool, budget, gate, timeout_s)
    except BaseException:
        hold.end()
        raise
    _mark(staged, hold, stats, staged.plan.rounds, staged.plan.pool_bytes)
    return staged


def budgeted_preload(
    gate: StagingGate,
    preload_fn: Callable[[], Any],
    buckets: Sequence[WriteBucket],
    limit: Any,
    cache: Optional[StagingBufferCache],
    overlapped: Optional[Callable[..., Any]],
    stats: dict,
    timeout_s: float = DEFAULT_STAGING_MEMORY_WAIT_S,
    rounds: bool = True,
) -> Callable[[], Any]:
    """Wrap a writer's ``preload_fn`` so that the save stays within the budget (trainer).

    ``gate`` (one word per tensor item of ``buckets``) also goes to the write path
    (``staging_control``), which takes the items as they arrive and marks it done.
    ``overlapped``: see :func:`stage_within_budget`.
    ``rounds`` False: the write path does not take ``staging_control`` (an override with
    the reference signature), so a state above the budget is refused.
    """
    return partial(
        stage_within_budget, gate, buckets, limit, cache, timeout_s, preload_fn,
        overlapped, stats, rounds,
    )
