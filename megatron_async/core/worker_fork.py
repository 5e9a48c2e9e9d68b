"""Start the persistent worker as a fork of the trainer (trainer side, and the child's set-up).

A fresh interpreter (:mod:`megatron_async.core.worker_process`) spends seconds of CPU
importing torch before it can take a save, CPU that a busy trainer pays for (the
lost-time benchmark measured ~3 CPU-seconds per rank). A fork has every module already
imported and is ready within milliseconds. What it inherits, and how each is kept from
costing the trainer or the checkpoint:

* **Memory, copy-on-write.** Before forking, the trainer lists the page-aligned insides
  of its CPU tensor storages (a scan of the live objects, once per worker start); the
  child discards its share of those pages at once (``MADV_DONTNEED``). The trainer's
  in-place updates of parameters and optimizer state then neither copy pages nor leave
  the old ones pinned in the worker, which would double the memory of CPU-resident
  state. The child also freezes the inherited objects out of its cyclic garbage
  collection, which would otherwise touch, and so copy, the whole inherited heap.
  The worker never reads the trainer's tensors: a request and its staged data reach it
  through its socket and shared memory, exactly as for a fresh interpreter.
* **Staging segments.** A fork would keep the trainer's shared-memory segments mapped
  (and their descriptors open) for the worker's lifetime. So the worker is forked only
  while the trainer has no live segment, which is the case when a caller is created;
  a worker restarted later (after one died) is a fresh interpreter.
* **CUDA.** A forked child cannot use CUDA; the worker never needs it, since the trainer
  stages every tensor to host shared memory before sending a request.
* **Signal handlers** the trainer installed are reset to a fresh interpreter's, so a
  trainer's handler (e.g. one that saves a checkpoint on SIGTERM) never runs in the worker.
* **Threads.** Only the forking thread exists in the child; torch's intra-op pool is set to
  one thread so the child never enters a parallel region whose threads it lost.
* **Descriptors.** The child keeps only what a fresh interpreter would have: standard
  input and output, the streams of ``sys.stdout``/``sys.stderr`` and of the logging
  handlers, and its own ends of its two sockets. Everything else the trainer had open is
  closed in the child: a listening socket (a rendezvous store's port) must be free to
  bind again once the trainer closes it, a pipe's reader must see EOF when the trainer
  closes its end, and the trainer's ends of the worker's own sockets must be the only
  ones, so that a dead worker reads as EOF in the trainer and a gone trainer in the
  worker.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.multiprocessing as mp

from megatron_async import BACKGROUND_WORKER_ENV
from megatron_async.core.shared_memory import has_live_segments
from megatron_async.core.worker_process import WorkerProcess
from megatron_async.errors import WorkerDiedError

__all__ = [
    "MIN_RELEASED_STORAGE_BYTES",
    "can_fork_worker",
    "close_inherited_descriptors",
    "fork_worker_process",
    "release_inherited_pages",
    "trainer_tensor_pages",
]

logger = logging.getLogger(__name__)

MIN_RELEASED_STORAGE_BYTES = 1 << 20
"""Tensor storages at least this large have their pages released in the forked worker;
smaller ones share at most a few pages each with the trainer."""

_MADV_DONTNEED = 4

PageRange = Tuple[int, int]
"""``(start address, length)``, both multiples of the page size."""


def can_fork_worker() -> bool:
    """Whether the next worker can start as a fork of this process (trainer side).

    Needs Linux's ``fork`` and ``madvise``, and no live shared-memory staging segment
    (see the module docstring).
    """
    return hasattr(os, "fork") and _libc_madvise() is not None and not has_live_segments()


_madvise_fn: Any = None


def _libc_madvise():
    """libc's ``madvise``, resolved in the trainer (never ``dlopen`` in a forked child)."""
    global _madvise_fn
    if _madvise_fn is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            _madvise_fn = False
        else:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise_fn = fn
    return _madvise_fn or None


def trainer_tensor_pages(min_bytes: int = MIN_RELEASED_STORAGE_BYTES) -> List[PageRange]:
    """The whole pages inside every live private CPU tensor storage of ``min_bytes`` or more.

    Runs on the trainer, just before the fork. Only whole pages are listed: the partial
    pages at either end may hold other allocations (or the allocator's bookkeeping), which
    the child may still touch. Shared-memory storages are skipped (a fork shares them
    without copy-on-write).
    """
    page = mmap.PAGESIZE
    seen = set()
    ranges: List[PageRange] = []
    objects = gc.get_objects()
    # Filter by type first (hundreds of thousands of objects: this is the scan's cost).
    # type(), not isinstance(): the latter reads ``__class__``, which some deprecated
    # module attributes turn into a warning.
    tensor_types = {t for t in set(map(type, objects)) if issubclass(t, torch.Tensor)}
    tensors = [obj for obj in objects if type(obj) in tensor_types]
    del objects
    for obj in tensors:
        try:
            if obj.device.type != "cpu" or obj.layout is not torch.strided:
                continue
            storage = obj.untyped_storage()
            address, size = storage.data_ptr(), storage.nbytes()
            if size < min_bytes or address in seen or storage.is_shared():
                continue
        except Exception:  # tensor subclasses without a storage (wrappers, fake tensors)
            continue
        seen.add(address)
        start = -(-address // page) * page
        end = (address + size) // page * page
        if end > start:
            ranges.append((start, end - start))
    return ranges


def release_inherited_pages(ranges: Sequence[PageRange], madvise) -> int:
    """Drop this (forked) process's share of ``ranges``; return the bytes released (worker side).

    After ``MADV_DONTNEED`` the pages read as zeros here, and the trainer owns its copies
    alone: its next write to each reuses the page instead of copying it.
    """
    released = 0
    for start, length in ranges:
        if madvise(start, length, _MADV_DONTNEED) == 0:
            released += length
    return released


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


def close_inherited_descriptors(keep: Set[int]) -> None:
    """Close every open descriptor of this (forked) process not in ``keep`` (worker side)."""
    try:
        open_fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every number up to the limit
        open_fds = range(os.sysconf("SC_OPEN_MAX"))
    for fd in open_fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, already gone


def _forked_worker_main(
    options: Dict[str, Any], ranges: Sequence[PageRange], madvise
) -> None:
    """Body of the forked worker: shed what the fork inherited, then serve (worker side)."""
    gc.freeze()  # the inherited objects: never walked (copied) by this process's collector
    gc.enable()  # the trainer disabled it around the fork
    keep = {0, 1, 2, options["control_fd"], options["descriptor_fd"]} | _output_stream_fds()
    close_inherited_descriptors(keep)
    release_inherited_pages(ranges, madvise)
    os.environ[BACKGROUND_WORKER_ENV] = "1"  # as in a fresh worker, for what it starts
    _reset_signal_handlers()
    torch.set_num_threads(1)
    from megatron_async.core.worker_loop import main

    main(options)


class _ForkedPopen:
    """The part of :class:`subprocess.Popen` that :class:`WorkerProcess` uses, over a forked
    :class:`multiprocessing.Process` (trainer side)."""

    def __init__(self, process):
        self._process = process
        self.pid = process.pid

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"persistent worker {self.pid}", timeout)
        return code


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
    madvise = _libc_madvise()
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
        ranges = trainer_tensor_pages()
        process = mp.get_context("fork").Process(
            target=_forked_worker_main,
            args=(options, ranges, madvise),
            name=f"megatron-async-worker-{rank}",
        )
        process.start()
    except OSError as exc:
        control.close()
        descriptors.close()
        raise WorkerDiedError(
            f"rank {rank}: cannot fork the persistent checkpoint worker: {exc}; free memory "
            "or raise the process limit, or start it as a fresh interpreter "
            "(AsyncCallerConfig(worker_start='exec'))"
        ) from exc
    finally:
        if gc_was_enabled:
            gc.enable()
        worker_control.close()  # the worker has its own copies now
        worker_descriptors.close()
    released = sum(length for _start, length in ranges)
    logger.debug(
        "rank %d: forked persistent worker pid %d; it drops its share of %.0f MiB of tensor pages",
        rank, process.pid, released / 2**20,
    )
    return WorkerProcess(
        _ForkedPopen(process), Connection(control.detach()), descriptors, None, rank, forked=True
    )
