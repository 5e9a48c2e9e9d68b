"""The staging copy threads of a trainer process, and bounded waits for their parts (trainer).

A part is one ``torch.cat`` of source pieces into one region of a staging segment
(:mod:`.flat_copy` plans them). ``torch.cat`` releases the GIL, so parts handed to these
threads run beside the training thread. The threads are daemons of this process, started
before any part is queued: a part is either queued for a running thread or copied by the
caller, never left in a queue that nothing serves, and a stuck copy cannot hold up the
interpreter's exit. Every wait for a part is bounded by its size (:func:`wait_all`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import List, Optional, Tuple

import torch

from megatron_async.core.coordination import local_world_size
from megatron_async.errors import AsyncTimeoutError, CheckpointValidationError

__all__ = [
    "COPY_THREADS_ENV", "CopyThreads", "Running", "StagingCopyTimeoutError", "copy_threads", "wait_all",
]

COPY_THREADS_ENV = "MEGATRON_ASYNC_STAGING_COPY_THREADS"
"""Overrides :func:`copy_threads` (an integer from 1 to 16; 1 copies on the training
thread only)."""

_DEFAULT_MAX_COPY_THREADS = 4
_MAX_COPY_THREADS = 16
_PART_WAIT_BASE_S = 30.0  # the wait for a part: this, plus its bytes at the rate below
_MIN_COPY_BYTES_PER_S = 50e6  # a copy slower than this is stuck

Running = List[Tuple[Future, torch.Tensor]]
"""Parts handed to the copy threads: each one's future and the region it copies into."""


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
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_DEFAULT_MAX_COPY_THREADS, cpus // local_world_size()))


class CopyThreads:
    """Daemon threads of one process that copy the parts handed to them (trainer).

    Threads are started before any part is queued, so a part is either queued for a
    running thread or copied by the caller, never left in a queue nobody serves; being
    daemons, a stuck copy cannot hold up the interpreter's exit. Threads belong to a
    process, so the pool is one per process: :meth:`of_process`.
    """

    _process: Optional["CopyThreads"] = None
    _process_lock = threading.Lock()

    @classmethod
    def of_process(cls) -> "CopyThreads":
        """This process's copy threads (a forked child starts its own: threads do not fork)."""
        with cls._process_lock:
            if cls._process is None or cls._process.pid != os.getpid():
                cls._process = cls()
            return cls._process

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0

    def hand_over(self, parts: List[Tuple[List[torch.Tensor], torch.Tensor]],
                  running: Running) -> List[Tuple[List[torch.Tensor], torch.Tensor]]:
        """Queue ``parts`` (each listed in ``running`` before it is queued), growing the pool
        to one thread per part (every thread it has serves the queue); return the parts to
        copy on the calling thread (none unless no thread could be started)."""
        with self._lock:
            while self._threads < len(parts):
                try:
                    threading.Thread(target=self._serve, daemon=True,
                                     name="megatron_async_staging_copy").start()
                except RuntimeError:  # "can't start new thread": use the ones running
                    break
                self._threads += 1
            if not self._threads:
                return list(parts)
        for pieces, region in parts:
            future: Future = Future()
            running.append((future, region))
            self._jobs.put((future, pieces, region))
        return []

    def _serve(self) -> None:
        while True:
            future, pieces, region = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                torch.cat(pieces, out=region)
            except BaseException as exc:  # handed to the waiting training thread
                future.set_exception(exc)
            else:
                future.set_result(None)
            # an idle thread keeps no reference: the segment is freed with its buffers
            del future, pieces, region


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
