"""One copy per bucket for CPU sources: the staging copy without a dispatch per tensor.

Runs in the trainer (the stager, inside :func:`~megatron_async.staging.buffers.stage_buckets`).
A bucket's cached buffers are exact-size views of one shared segment, laid out in the
order of the bucket's items. For CPU sources that are contiguous, the whole bucket is
then one ``torch.cat`` of the sources' bytes into that region of the segment: one
operator call whose loop runs in C++, instead of one ``copy_`` per tensor (which a CPU
``torch._foreach_copy_`` still dispatches pair by pair, about 3 us per tensor).

The flat byte views of the sources cost about 4 us per tensor to create, so a
:class:`FlatCopy` is built once for a bucket's cached buffers and reused while every
source still starts at the address its view reads, with the same byte count, contiguous.
That check is four ``map`` calls over the sources (no Python bytecode per tensor):

* the views hold the sources' storages, so a source whose address still equals its
  view's shares the view's memory (a freed storage could be reused at the same address
  only if nothing held it);
* the byte count and contiguity make the view read exactly the source's bytes, in its
  logical order (an in-place ``resize_`` or ``t_()`` keeps the address).

Holding the views keeps the sources' storages alive as long as the cached buffers (until
a save of another layout, or the cache's ``clear``); a source replaced by new memory
fails the check and its storage is let go at the next save.

A bucket of at least :data:`SPLIT_MIN_BYTES` is cut into runs of about equal bytes, each
its own ``torch.cat`` on its own thread (:func:`copy_threads`; one thread alone does not
reach a node's memory bandwidth, docs/benchmarks.md): one on the calling thread, the others
on the process's :class:`~megatron_async.core.helper_threads.HelperThreads`. The copy
returns once every part is copied, each wait bounded by the part's size (:func:`wait_all`).

CUDA sources never come here: they keep the page-locked buffers, non-blocking copies and
one synchronize of :func:`~megatron_async.staging.buffers.copy_batched`.
"""

from __future__ import annotations

import operator
import os
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_async.core.coordination import local_world_size
from megatron_async.core.helper_threads import HelperThreads
from megatron_async.core.shared_memory import ALIGNMENT
from megatron_async.errors import AsyncTimeoutError, CheckpointValidationError

__all__ = [
    "COPY_THREADS_ENV", "FlatCopy", "SPLIT_MIN_BYTES", "StagingCopyTimeoutError",
    "copy_threads", "wait_all",
]

COPY_THREADS_ENV = "MEGATRON_ASYNC_STAGING_COPY_THREADS"
"""Overrides :func:`copy_threads` (an integer from 1 to 16; 1 copies on the training
thread only)."""

_DEFAULT_MAX_COPY_THREADS = 4
_MAX_COPY_THREADS = 16
_PART_WAIT_BASE_S = 30.0  # the wait for a part: this, plus its bytes at the rate below
_MIN_COPY_BYTES_PER_S = 50e6  # a copy slower than this is stuck

Running = List[Tuple[Future, torch.Tensor]]
"""Parts handed to helper threads: each one's future and the region it copies into."""


class StagingCopyTimeoutError(AsyncTimeoutError):
    """A copy thread of the staging did not finish its part in time; it may still write
    into the buffers, which are therefore never used again (stager)."""


def copy_threads() -> int:
    """How many threads copy one large bucket: the CPUs this process may run on, shared by
    the node's local ranks (torchrun's ``LOCAL_WORLD_SIZE``), at most 4 and at least 1;
    :data:`COPY_THREADS_ENV` overrides it."""
    configured = os.environ.get(COPY_THREADS_ENV)
    if configured:
        try:
            return max(1, min(_MAX_COPY_THREADS, int(configured)))
        except ValueError:
            raise CheckpointValidationError(
                f"{COPY_THREADS_ENV}={configured!r} is not an integer; set it to the number of "
                "threads that copy a bucket (1: the training thread only)"
            ) from None
    cpus = len(os.sched_getaffinity(0))
    return max(1, min(_DEFAULT_MAX_COPY_THREADS, cpus // local_world_size()))


def _start_part(pieces: List[torch.Tensor], region: torch.Tensor) -> Future:
    """Copy one part on a helper thread of this process; its future says how it ended."""
    future: Future = Future()

    def copy_part() -> None:
        try:
            torch.cat(pieces, out=region)
        except BaseException as exc:  # handed to the waiting training thread
            future.set_exception(exc)
        else:
            future.set_result(None)

    HelperThreads.of_process().start(copy_part, "megatron-async-staging-copy")
    return future


def wait_all(running: Running):
    """Wait for every handed-over part, each bounded by its size (training thread).

    An interrupt (``KeyboardInterrupt``, an exception of a signal handler) that arrives
    while waiting does not end the wait: it is returned once every part ended or passed
    its bound. Returns ``(stuck, interrupt, error)``: whether a part is still running
    past its bound, the first interrupt, and the first error (a part's own, or
    :class:`StagingCopyTimeoutError` for a stuck one).
    """
    interrupt: Optional[BaseException] = None
    error: Optional[BaseException] = None
    stuck = False
    for future, region in running:
        timeout_s = _PART_WAIT_BASE_S + region.numel() / _MIN_COPY_BYTES_PER_S
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if future.done() or time.monotonic() >= deadline:
                    break
                futures_wait([future], timeout=max(0.0, deadline - time.monotonic()))
            except BaseException as exc:  # an interrupt: the part still writes, so wait on
                interrupt = interrupt or exc
        if not future.done():
            stuck = True
            error = error or StagingCopyTimeoutError(
                f"a staging copy thread did not copy {region.numel()} bytes within "
                f"{timeout_s:.0f}s; the host is overloaded or stuck. Set {COPY_THREADS_ENV}=1 "
                "to copy on the training thread only"
            )
        elif future.exception() is not None:
            error = error or future.exception()
    return stuck, interrupt, error


SPLIT_MIN_BYTES = 8 * 2**20
"""A bucket smaller than this is copied by the calling thread alone (a hand-over to a
pool thread costs tens of microseconds)."""

_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_nbytes = operator.attrgetter("nbytes")

_PADDING = torch.zeros(ALIGNMENT, dtype=torch.uint8)
"""Bytes that fill the alignment gaps between buffers (never read back: each buffer is
a view of its own bytes)."""


class FlatCopy:
    """Copies a bucket's contiguous CPU sources into its buffers' region with one ``torch.cat``.

    Built and used by the stager, for the cached buffers of one bucket.

    Attributes:
        hits: the saves this copy served after the one it was built in.
    """

    __slots__ = ("_views", "_addresses", "_nbytes", "_parts", "hits", "stuck")

    def __init__(self, views: List[torch.Tensor], nbytes: List[int],
                 pieces: List[torch.Tensor], region: torch.Tensor, threads: int = 1) -> None:
        self._views = views  # held: they keep the sources' storages at these addresses
        self._addresses = list(map(_data_ptr, views))  # a view's address never changes
        self._nbytes = nbytes
        self._parts = _split(pieces, region, threads)
        self.hits = 0
        self.stuck = False  # a part outlived its bound: its thread may still write

    @classmethod
    def build(
        cls, sources: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
        segment: Optional[torch.Tensor], threads: int = 1,
    ) -> Optional["FlatCopy"]:
        """Plan the one-call copy of ``sources`` into ``buffers`` (views of ``segment``).

        ``threads``: how many threads may copy a region of at least
        :data:`SPLIT_MIN_BYTES` (the copy is cut into that many parts).

        Returns None where it does not apply: a source on another device than the CPU, or
        not contiguous, or buffers that are not views of ``segment`` in the items' order.
        """
        if segment is None or not sources or not all(map(_is_contiguous, sources)):
            return None
        if any(source.device.type != "cpu" for source in sources):
            return None
        base = segment.data_ptr()
        start = end = None
        views: List[torch.Tensor] = []
        pieces: List[torch.Tensor] = []
        with torch.no_grad():
            for source, buffer in zip(sources, buffers):
                view = source.detach().reshape(-1).view(torch.uint8)
                views.append(view)
                num_bytes = view.numel()
                if not num_bytes:
                    continue  # an empty buffer lives outside the segment; nothing to copy
                offset = buffer.data_ptr() - base
                if start is None:
                    start = end = offset
                gap = offset - end
                if gap < 0 or gap >= ALIGNMENT or buffer.nbytes != num_bytes:
                    return None
                if gap:
                    pieces.append(_PADDING[:gap])
                pieces.append(view)
                end = offset + num_bytes
        if start is None or end > segment.numel():
            return None
        return cls(views, list(map(_nbytes, views)), pieces, segment[start:end], threads)

    def matches(self, sources: Sequence[torch.Tensor]) -> bool:
        """Whether every source still is the memory its view reads (see the module notes)."""
        return (
            len(sources) == len(self._addresses)
            and list(map(_data_ptr, sources)) == self._addresses
            and list(map(_nbytes, sources)) == self._nbytes
            and all(map(_is_contiguous, sources))
        )

    @property
    def parts(self) -> int:
        """Into how many parts, each one ``torch.cat`` on its own thread, the copy is cut."""
        return len(self._parts)

    def copy(self) -> None:
        """Copy the sources' current bytes into the buffers (one ``torch.cat`` per part).

        Returns once every part is copied. Raises what a part raised, or an interrupt,
        after every other part ended: no thread writes into the buffers after this
        returns or raises, unless a part is stuck past its bound: then ``stuck`` is set
        (the caller drops the buffers) and :class:`StagingCopyTimeoutError` is raised,
        or the interrupt or error that came first.
        """
        (pieces, region), *others = self._parts
        if not others:
            torch.cat(pieces, out=region)
            return
        running: Running = []
        failure: Optional[BaseException] = None
        try:
            for part_pieces, part_region in others:
                running.append((_start_part(part_pieces, part_region), part_region))
            torch.cat(pieces, out=region)
        except BaseException as exc:  # raised once every part handed over has ended
            failure = exc
        self.stuck, interrupt, error = wait_all(running)
        raised = interrupt or failure or error  # an interrupt first, then this thread's error
        if raised is not None:
            raise raised


def _split(pieces: List[torch.Tensor], region: torch.Tensor,
           threads: int) -> List[Tuple[List[torch.Tensor], torch.Tensor]]:
    """Cut the copy into at most ``threads`` runs of whole pieces of about equal bytes."""
    total = region.numel()
    if threads <= 1 or total < SPLIT_MIN_BYTES:
        return [(pieces, region)]
    parts = []
    start = run_start = copied = 0
    for index, piece in enumerate(pieces):
        copied += piece.numel()
        if copied * threads >= total * (len(parts) + 1) and len(parts) < threads - 1:
            parts.append((pieces[run_start:index + 1], region[start:copied]))
            start, run_start = copied, index + 1
    if run_start < len(pieces):
        parts.append((pieces[run_start:], region[start:copied]))
    return parts


