"""Start the persistent worker as a fork of the trainer (trainer side, and the child's set-up).

A fork has every module already imported and is ready within milliseconds (a fresh
interpreter would spend seconds of CPU importing torch, which a busy trainer pays for); the
trainer's own cost is the scan below (about 0.1 s in the GPT example) and copying its
page tables. What the child inherits, and how each is kept from costing the trainer or
the checkpoint:

* **Memory, copy-on-write.** Before forking, the trainer lists the page-aligned insides
  of its private CPU tensor storages that Python can see (:func:`trainer_tensor_pages`, a
  scan of the live objects, once per worker start); the child discards its share of
  those pages at once (:func:`release_inherited_pages`, ``MADV_DONTNEED``). The
  trainer's in-place updates of parameters and optimizer state then neither copy pages
  nor leave the old ones pinned in the worker, which would double the memory of
  CPU-resident state. (Storages held only by C++ code are not found; their pages stay
  copy-on-write.) The child also freezes the inherited objects out of its cyclic garbage
  collection, which would otherwise touch, and so copy, the whole inherited heap. The
  worker never reads the trainer's tensors: a request and its staged data reach it
  through its socket and shared memory.
* **Staging segments.** The child would keep the trainer's shared-memory segments mapped
  for its whole life, so their memory would outlive the trainer's use of them. The child
  replaces its mapping of every registered segment with private zero pages at once
  (:func:`release_inherited_segments`); the address ranges stay taken, so nothing the
  child maps later lands where a stale inherited object points. A segment the worker
  needs it opens anew, as it does one made after the fork.
* **CUDA.** A forked child cannot use CUDA; the worker never needs it, since the trainer
  stages every tensor to host shared memory before sending a request.
* **Signal handlers** the trainer installed are reset to a fresh interpreter's first
  thing, so a trainer's handler (e.g. one that saves a checkpoint on SIGTERM) never runs
  in the worker.
* **Threads.** Only the forking thread exists in the child; torch's intra-op pool is set to
  one thread so the child never enters a parallel region whose threads it lost.
* **Descriptors.** The child keeps what a fresh interpreter would have: standard input
  and output, the streams of ``sys.stdout``/``sys.stderr`` and of the logging handlers,
  and its own end of its socket. Every other descriptor the trainer had open is
  pointed at ``/dev/null`` in the child (not closed: an inherited object that still
  writes to its old number must not land in a checkpoint file that reused it). So a
  listening socket (a rendezvous store's port) is free to bind again once the trainer
  closes it, a pipe's reader sees EOF when the trainer closes its end, and the trainer's
  end of the worker's own socket is the only one: a dead worker reads as EOF in the
  trainer and a gone trainer in the worker.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import mmap
import os
import signal
import sys
import traceback
from typing import Any, Dict, List, Sequence, Set, Tuple

import torch

from megatron_async import BACKGROUND_WORKER_ENV
from megatron_async.core import worker_loop
from megatron_async.core.shared_memory import segment_ranges

__all__ = [
    "MIN_RELEASED_STORAGE_BYTES",
    "fork_worker",
    "release_inherited_pages",
    "release_inherited_segments",
    "retire_inherited_descriptors",
    "trainer_tensor_pages",
]

logger = logging.getLogger(__name__)

MIN_RELEASED_STORAGE_BYTES = 1 << 20
"""Tensor storages at least this large have their pages released in the forked worker;
smaller ones share at most a few pages each with the trainer."""

_MADV_DONTNEED = 4

# mmap(2) on Linux: private zero pages that replace whatever was mapped at the address.
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_PRIVATE_ANONYMOUS_FIXED = 0x02 | 0x20 | 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value

PageRange = Tuple[int, int]
"""``(start address, length)``, both multiples of the page size."""


# libc's madvise and mmap, resolved here so that the child only calls them.
_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mmap.restype = ctypes.c_void_p


# -- the trainer's tensor pages (trainer side, before the fork) ---------------------------


def trainer_tensor_pages(
    min_bytes: int = MIN_RELEASED_STORAGE_BYTES,
) -> Tuple[List[PageRange], List[torch.UntypedStorage]]:
    """The whole pages inside every live private CPU tensor storage of ``min_bytes`` or more.

    Runs on the trainer, just before the fork. Returns the ranges and the storages they
    belong to: keep the storages referenced until the child exists, so that no range is
    freed and reused by other data in between. Only whole pages are listed (the partial
    pages at either end may hold other allocations, or the allocator's bookkeeping,
    which the child may still touch). Shared-memory storages are skipped (a fork shares
    them without copy-on-write). Whatever mapping a range lies in, ``MADV_DONTNEED`` in
    the child drops only the child's view of it, never the trainer's data.
    """
    page = mmap.PAGESIZE
    seen = set()
    ranges: List[PageRange] = []
    storages: List[torch.UntypedStorage] = []
    objects = gc.get_objects()
    # Filter by type first (hundreds of thousands of objects: this is the scan's cost),
    # with map/compress so that the loop over every object runs in C, not in bytecode
    # (a list comprehension took 60 of the scan's 130 ms in the GPT example).
    # type(), not isinstance(): the latter reads ``__class__``, which some deprecated
    # module attributes turn into a warning.
    kinds = list(map(type, objects))
    tensor_types = {t for t in set(kinds) if issubclass(t, torch.Tensor)}
    tensors = list(itertools.compress(objects, map(tensor_types.__contains__, kinds)))
    del objects, kinds
    for obj in tensors:
        try:
            if obj.layout is not torch.strided:
                continue
            storage = obj.untyped_storage()
            if storage.device.type != "cpu":
                continue
            address, size = storage.data_ptr(), storage.nbytes()
            if address == 0 or size < min_bytes or address in seen or storage.is_shared():
                continue
        except Exception:  # tensor subclasses without a storage (wrappers, fake tensors)
            continue
        seen.add(address)
        start = -(-address // page) * page
        end = (address + size) // page * page
        if end > start:
            ranges.append((start, end - start))
            storages.append(storage)
    return ranges, storages


# -- the child's set-up (worker side) -----------------------------------------------------


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


def release_inherited_segments(ranges: Sequence[PageRange], mmap_fn) -> None:
    """Map private zero pages over this (forked) process's inherited staging segments (worker side).

    The shared memory then belongs to the trainer alone and is freed when it drops a
    segment; an inherited object that still points there reads zeros.
    """
    for start, length in ranges:
        if mmap_fn(start, length, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS_FIXED, -1, 0) == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"cannot replace the inherited segment at {start:#x}")


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
    open_fds = [int(name) for name in os.listdir("/proc/self/fd")]  # the worker needs /proc anyway
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


def _run_child(options: Dict[str, Any], ranges: Sequence[PageRange]) -> None:
    """Shed what the fork inherited, then serve; never returns into the trainer's code
    (worker side). A failure is reported on the trainer's stderr and by the exit code."""
    code = 1
    try:
        _reset_signal_handlers()  # first: no trainer handler may run here
        gc.freeze()  # the inherited objects: never walked (copied) by this process's collector
        gc.enable()  # the trainer disabled it around the fork
        keep = {0, 1, 2, options["control_fd"]} | _output_stream_fds()
        if options["stack_file"] is not None:
            keep.add(options["stack_file"].fileno())
        retire_inherited_descriptors(keep)
        release_inherited_pages(ranges, _madvise)
        release_inherited_segments(segment_ranges(), _mmap)
        os.environ[BACKGROUND_WORKER_ENV] = "1"  # for what it starts: skips strategy registration
        torch.set_num_threads(1)
        worker_loop.main(options)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
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


# -- the fork (trainer side) ------------------------------------------------------------


def fork_worker(options: Dict[str, Any]) -> int:
    """Fork the persistent worker (trainer side); return its pid at once.

    The child sheds what it inherited (see the module docstring) and runs
    :func:`megatron_async.core.worker_loop.main` with ``options``, saying ``("ready",
    None)`` within milliseconds.

    Raises:
        OSError: the fork failed (no memory for the page tables, a process limit).
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collection between the scan and the child's freeze
    try:
        ranges, storages = trainer_tensor_pages()
        pid = os.fork()
        if pid == 0:
            _run_child(options, ranges)
    finally:
        if gc_was_enabled:
            gc.enable()
    del storages  # the child has dropped or is dropping its share of them
    logger.debug(
        "rank %d: forked persistent worker pid %d; it drops its share of %.0f MiB of tensor pages",
        options["rank"], pid, sum(length for _start, length in ranges) / 2**20,
    )
    return pid
