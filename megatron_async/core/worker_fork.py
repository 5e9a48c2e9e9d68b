"""Start the persistent worker as a fork of the trainer (trainer side, and the child's set-up).

A fresh interpreter (:mod:`megatron_async.core.worker_process`) spends seconds of CPU
importing torch before it can take a save, CPU that a busy trainer pays for (the
lost-time benchmark measured ~3 CPU-seconds per rank). A fork has every module already
imported and is ready within milliseconds of the fork; the trainer's own cost is the
scan below (about 0.1 s in the GPT example) and copying its page tables. What the child
inherits, and how each is kept from costing the trainer or the checkpoint:

* **Memory, copy-on-write.** Before forking, the trainer lists the page-aligned insides
  of its private CPU tensor storages that Python can see (a scan of the live objects,
  once per worker start), clipped to its private anonymous mappings; the child discards
  its share of those pages at once (``MADV_DONTNEED``). The trainer's in-place updates
  of parameters and optimizer state then neither copy pages nor leave the old ones
  pinned in the worker, which would double the memory of CPU-resident state
  (:mod:`megatron_async.core.fork_pages`). (Storages held only by C++ code are not
  found; their pages stay copy-on-write.) The child also
  freezes the inherited objects out of its cyclic garbage collection, which would
  otherwise touch, and so copy, the whole inherited heap. The worker never reads the
  trainer's tensors: a request and its staged data reach it through its socket and
  shared memory, exactly as for a fresh interpreter.
* **Staging segments.** A fork would keep the trainer's shared-memory segments mapped
  (and their descriptors open) for the worker's lifetime. So the worker is forked only
  while the trainer has no live segment, as when a queue is created before the first
  save; otherwise (a worker restarted while the strategy keeps its staging buffers for
  the next save, say) it is a fresh interpreter.
* **CUDA.** A forked child cannot use CUDA; the worker never needs it, since the trainer
  stages every tensor to host shared memory before sending a request.
* **Signal handlers** the trainer installed are reset to a fresh interpreter's first
  thing, so a trainer's handler (e.g. one that saves a checkpoint on SIGTERM) never runs
  in the worker.
* **Threads.** Only the forking thread exists in the child; torch's intra-op pool is set to
  one thread so the child never enters a parallel region whose threads it lost.
* **Descriptors.** The child keeps what a fresh interpreter would have: standard input
  and output, the streams of ``sys.stdout``/``sys.stderr`` and of the logging handlers,
  and its own ends of its two sockets. Every other descriptor the trainer had open is
  pointed at ``/dev/null`` in the child (not closed: an inherited object that still
  writes to its old number must not land in a checkpoint file that reused it). So a
  listening socket (a rendezvous store's port) is free to bind again once the trainer
  closes it, a pipe's reader sees EOF when the trainer closes its end, and the trainer's
  ends of the worker's own sockets are the only ones: a dead worker reads as EOF in the
  trainer and a gone trainer in the worker.
* **Reaping.** The child is a plain ``os.fork``, reaped by its own non-blocking
  ``waitpid`` polls, so every wait on it is bounded and no exit hook of
  ``multiprocessing`` joins it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Dict, Optional, Sequence, Set

import torch

from megatron_async import BACKGROUND_WORKER_ENV
from megatron_async.core.fork_pages import (
    MIN_RELEASED_STORAGE_BYTES,
    PageRange,
    libc_madvise,
    release_inherited_pages,
    trainer_tensor_pages,
)
from megatron_async.core.shared_memory import has_live_segments
from megatron_async.core.worker_process import WorkerProcess
from megatron_async.errors import WorkerDiedError

__all__ = [
    "MIN_RELEASED_STORAGE_BYTES",
    "can_fork_worker",
    "retire_inherited_descriptors",
    "fork_worker_process",
    "release_inherited_pages",
    "trainer_tensor_pages",
]

logger = logging.getLogger(__name__)


def can_fork_worker() -> bool:
    """Whether the next worker can start as a fork of this process (trainer side).

    Needs Linux's ``fork`` and ``madvise``, and no live shared-memory staging segment
    (see the module docstring).
    """
    return hasattr(os, "fork") and libc_madvise() is not None and not has_live_segments()


def _reset_signal_handlers() -> None:
    """Give the child a fresh interpreter's handlers for every signal the trainer handles in Python."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if sig == signal.SIGINT:
            fresh = signal.default_int_handler
        elif callable(handler):
            fresh = signal.SIG_DFL
        else:
            continue
        if handler is not fresh:
            try:
                signal.signal(sig, fresh)
            except (OSError, ValueError):
                pass


def _output_stream_fds() -> Set[int]:
    """Descriptors that this process's ``sys`` streams and logging handlers write to."""
    streams = [sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__]
    loggers = [logging.getLogger()] + [
        candidate for candidate in logging.Logger.manager.loggerDict.values()
        if isinstance(candidate, logging.Logger)
    ]
    for each in loggers:
        streams += [getattr(handler, "stream", None) for handler in each.handlers]
    fds = set()
    for stream in streams:
        try:
            fds.add(stream.fileno())
        except Exception:  # None, closed, or a stream without a descriptor
            continue
    return fds


def retire_inherited_descriptors(keep: Set[int]) -> None:
    """Point every open descriptor of this (forked) process not in ``keep`` at ``/dev/null``.

    Runs in the worker. The trainer's files, sockets and pipes lose this process's
    reference, while their numbers stay taken: a stale inherited object that still
    writes to one writes to ``/dev/null``, never into a file opened later.
    """
    try:
        open_fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every number up to the limit
        open_fds = list(range(os.sysconf("SC_OPEN_MAX")))
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in open_fds:
            if fd in keep or fd == null:
                continue
            try:
                os.fstat(fd)  # dup2 onto a closed number would open it
            except OSError:
                continue  # not open (the listing's own descriptor, or never was)
            os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)
    try:
        signal.set_wakeup_fd(-1)  # the trainer's wakeup descriptor is /dev/null now
    except (ValueError, OSError):
        pass


def _forked_worker_main(
    options: Dict[str, Any], ranges: Sequence[PageRange], madvise
) -> None:
    """Body of the forked worker: shed what the fork inherited, then serve (worker side)."""
    _reset_signal_handlers()  # first: no trainer handler may run here
    gc.freeze()  # the inherited objects: never walked (copied) by this process's collector
    gc.enable()  # the trainer disabled it around the fork
    keep = {0, 1, 2, options["control_fd"], options["descriptor_fd"]} | _output_stream_fds()
    retire_inherited_descriptors(keep)
    release_inherited_pages(ranges, madvise)
    os.environ[BACKGROUND_WORKER_ENV] = "1"  # as in a fresh worker, for what it starts
    torch.set_num_threads(1)
    from megatron_async.core.worker_loop import main

    main(options)


_REAP_POLL_S = 0.01


class _ForkedChild:
    """The part of :class:`subprocess.Popen` that :class:`WorkerProcess` uses, over a child
    of ``os.fork`` (trainer side). Every wait polls ``waitpid(WNOHANG)``: bounded."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, how is unknown
                self.returncode = 1
            else:
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"persistent worker {self.pid}", timeout)
            time.sleep(_REAP_POLL_S)
        return self.returncode


def _run_child(options: Dict[str, Any], ranges: Sequence[PageRange], madvise) -> None:
    """What the forked child runs; never returns into the trainer's code (worker side)."""
    code = 1
    try:
        _forked_worker_main(options, ranges, madvise)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # reported on the trainer's stderr; the trainer sees the exit code
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code)


def fork_worker_process(
    rank: int, log_level: int, priority: Optional[Dict[str, Any]] = None
) -> WorkerProcess:
    """Fork the persistent worker of ``rank`` (trainer side); return at once.

    The worker runs :func:`megatron_async.core.worker_loop.main`, like a fresh
    interpreter's, and says ``("ready", None)`` within milliseconds. Check
    :func:`can_fork_worker` first.

    Raises:
        WorkerDiedError: the fork failed (no memory for the page tables, process limit).
    """
    madvise = libc_madvise()
    control, worker_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    descriptors, worker_descriptors = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    options = {
        "rank": rank,
        "parent_pid": os.getpid(),
        "log_level": log_level,
        "cuda_device": None,  # a forked child must not touch CUDA
        "control_fd": worker_control.fileno(),
        "descriptor_fd": worker_descriptors.fileno(),
        "stderr_fd": None,  # it writes to the trainer's stderr from the start
        "priority": priority,
    }
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collection between the scan and the child's freeze
    try:
        ranges, storages = trainer_tensor_pages()
        pid = os.fork()
        if pid == 0:
            _run_child(options, ranges, madvise)
    except Exception as exc:
        control.close()
        descriptors.close()
        raise WorkerDiedError(
            f"rank {rank}: cannot fork the persistent checkpoint worker: {exc}"
        ) from exc
    finally:
        if gc_was_enabled:
            gc.enable()
        worker_control.close()  # the worker has its own copies now
        worker_descriptors.close()
    del storages  # the child has dropped or is dropping its share of them
    logger.debug(
        "rank %d: forked persistent worker pid %d; it drops its share of %.0f MiB of tensor pages",
        rank, pid, sum(length for _start, length in ranges) / 2**20,
    )
    return WorkerProcess(
        _ForkedChild(pid), Connection(control.detach()), descriptors, None, rank, forked=True
    )
