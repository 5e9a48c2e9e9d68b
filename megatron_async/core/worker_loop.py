"""What runs in the persistent worker: the set-up after the fork, then the main loop.

The worker is a fork of the trainer that runs :func:`run_child` and never returns into
the trainer's code; :mod:`megatron_async.core.worker_process` says what it sheds and why.

Protocol over the control connection, trainer -> worker:
    ``(call_idx, encoded_request)``: map the request's new shared-memory segments and
    unpickle it (:class:`SegmentTable`; the encoding is
    :mod:`megatron_async.core.request_transport`'s, its data already staged by the
    trainer), then write;
    ``STOP``: finish the writes already accepted and exit.
Worker -> trainer: the callers' protocol (:mod:`megatron_async.core.caller`).

Receiving and writing run on different threads, so a second request is taken while the
first is still being written.
"""

from __future__ import annotations

import ctypes
import gc
import io
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, Dict, Optional, Sequence, Set, Tuple

import torch

from megatron_async.core import request_transport, shared_memory
from megatron_async.core.caller import STARTED, run_call, stacks_due
from megatron_async.core.process_lifetime import enter_background
from megatron_async.core.request_transport import EncodedRequest
from megatron_async.errors import CoordinationError, RankFailure

__all__ = ["STOP", "SegmentTable", "run_child"]

STOP = "STOP"

logger = logging.getLogger(__name__)

_MADV_DONTNEED = 4

# mmap(2) on Linux: private zero pages that replace whatever was mapped at the address.
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_PRIVATE_ANONYMOUS_FIXED = 0x02 | 0x20 | 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value

# libc's madvise and mmap, resolved here so that the child only calls them.
_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mmap.restype = ctypes.c_void_p


# -- the set-up after the fork ------------------------------------------------------------


def release_inherited_pages(ranges: Sequence[Tuple[int, int]]) -> None:
    """Drop this (forked) process's share of the trainer's tensor pages ``ranges``.

    After ``MADV_DONTNEED`` the pages read as zeros here; the trainer's copies are its own.
    """
    for start, length in ranges:
        _madvise(start, length, _MADV_DONTNEED)


def release_inherited_segments() -> None:
    """Map private zero pages over this (forked) process's inherited staging segments.

    An inherited object that still points there reads zeros.
    """
    for start, length in shared_memory.segment_ranges():
        if _mmap(start, length, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS_FIXED, -1, 0) == _MAP_FAILED:
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

    Not closed: the numbers stay taken, so a stale inherited object that still writes to
    one writes to ``/dev/null``, never into a checkpoint file opened later.
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


def run_child(options: Dict[str, Any], ranges: Sequence[Tuple[int, int]]) -> None:
    """Shed what the fork inherited, then serve until ``STOP``; never returns into the
    trainer's code (worker side). A failure is reported on the trainer's stderr and by the
    exit code.

    Args:
        options: what :func:`~megatron_async.core.worker_process.start_worker` passes:
            ``rank`` (the trainer's global rank, for messages), ``parent_pid`` (the worker
            dies with the trainer, and opens its descriptors through ``/proc/<parent_pid>``),
            ``nice_increment``, the inherited descriptor ``control_fd`` (requests in,
            results out), and ``timeout_s`` (each call's, for :func:`~megatron_async.core.caller.stacks_due`).
        ranges: the trainer's tensor pages to release
            (:func:`~megatron_async.core.worker_process.trainer_tensor_pages`).
    """
    code = 1
    try:
        enter_background(options["parent_pid"], options["nice_increment"])  # before any thread
        _reset_signal_handlers()  # next: no trainer handler may run here
        gc.freeze()  # the inherited objects: never walked (copied) by this process's collector
        gc.enable()  # the trainer disabled it around the fork
        keep = {0, 1, 2, options["control_fd"]} | _output_stream_fds()
        retire_inherited_descriptors(keep)
        release_inherited_pages(ranges)
        release_inherited_segments()
        torch.set_num_threads(1)
        table = SegmentTable(options["parent_pid"])
        _serve(options["rank"], Connection(options["control_fd"]), table, options["timeout_s"])
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


# -- the main loop ------------------------------------------------------------------------


def _write_loop(rank: int, jobs: "queue.Queue", report: Callable, table: "SegmentTable") -> None:
    """Writer thread: run each accepted request's ``async_fn`` in order."""
    while True:
        job = jobs.get()
        if job is None:
            return
        call_idx, request, call_segments, due = job
        outcome = run_call(
            rank, call_idx, request.async_fn, request.async_fn_args, request.async_fn_kwargs or {},
            due,
        )
        del job, request  # the call's staged data, before the trainer frees it
        table.drop(call_segments)
        report(outcome)


def _serve(rank: int, control: Connection, table: "SegmentTable", timeout_s: float) -> None:
    """Take requests and hand them to the writer thread until ``STOP``; each call's
    ``timeout_s`` counts from its arrival here, as the trainer's from its sending."""
    lock = threading.Lock()  # both threads report

    def report(message) -> None:
        with lock:
            control.send(message)

    jobs: "queue.Queue" = queue.Queue()
    writer = threading.Thread(target=_write_loop, args=(rank, jobs, report, table), daemon=True)
    writer.start()
    report(STARTED)
    logger.debug("rank %d worker %d: started", rank, os.getpid())
    while True:
        try:
            message = control.recv()  # a trainer that dies kills this process (enter_background)
            due = stacks_due(time.monotonic(), timeout_s)
        except (EOFError, OSError):
            logger.warning("rank %d worker: the trainer closed the connection; exiting", rank)
            os._exit(1)
        if message == STOP:
            jobs.put(None)
            writer.join()
            return
        call_idx, encoded = message
        try:
            request = table.apply(encoded)
        except BaseException as exc:
            # The trainer now believes segments or reused pairs reached this worker that
            # may not have: finish the accepted writes and exit, so that the next save
            # starts a fresh worker with a fresh view of what was sent.
            logger.error("rank %d worker: cannot read async call %d: %s", rank, call_idx, exc)
            report((call_idx, RankFailure.from_exception(rank, "schedule", exc)))
            jobs.put(None)
            writer.join()
            os._exit(1)
        jobs.put((call_idx, request, encoded.call_segments, due))
        del request, encoded


# -- reading requests ---------------------------------------------------------------------


class SegmentTable:
    """The segments and reused pairs one worker has received, and the decoding of requests
    that refer to them (one per worker, fed by one
    :class:`~megatron_async.core.request_transport.RequestSender`)."""

    def __init__(self, trainer_pid: int):
        self._trainer_pid = trainer_pid
        self._segments: Dict[int, torch.Tensor] = {}
        self._pairs: Dict[int, Any] = {}

    def apply(self, encoded: EncodedRequest) -> Any:
        """Drop forgotten pairs and segments, map new ones, and return the unpickled request.

        Raises:
            CoordinationError: a new segment cannot be opened through ``/proc``.
        """
        for token in encoded.forget_pairs:
            self._pairs.pop(token, None)
        for sid in encoded.forget:
            self._segments.pop(sid, None)
        for sid, number, num_bytes in encoded.new_segments:
            path = f"/proc/{self._trainer_pid}/fd/{number}"
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                raise CoordinationError(
                    f"persistent worker: cannot open the trainer's staging segment {sid} as "
                    f"{path} ({exc}); the worker maps the trainer's shared memory through /proc, "
                    "which a system that hides a process's descriptors from its own children "
                    "refuses: use the temporal caller (AsyncCallsQueue(persistent=False))"
                ) from exc
            try:
                storage = torch.UntypedStorage._new_shared_fd_cpu(fd, num_bytes)
            finally:
                os.close(fd)
            self._segments[sid] = torch.empty(0, dtype=torch.uint8).set_(storage)
        return self.load(encoded.payload)

    def load(self, payload: bytes) -> Any:
        """Unpickle ``payload``, resolving its references to segments and reused pairs here."""
        return _Unpickler(io.BytesIO(payload), self).load()

    def load_pairs(self, token: Optional[int], payload: bytes) -> Any:
        """Reused pairs sent in full: kept under ``token`` (if any) for later requests."""
        pairs = self.load(payload)
        if token is not None:
            self._pairs[token] = pairs
        return pairs

    def rebuild_tensor(self, segment_id: int, byte_offset: int, shape, dtype) -> torch.Tensor:
        """A tensor over the mapped segment ``segment_id``'s bytes."""
        segment = self._received(self._segments, segment_id, "shared-memory segment")
        return shared_memory.segment_view(segment, byte_offset, shape, dtype)

    def cached_pairs(self, token: int) -> Any:
        """Reused pairs sent with an earlier request (the same list object every time)."""
        return self._received(self._pairs, token, "reused pairs")

    @staticmethod
    def _received(table: Dict[int, Any], key: int, what: str) -> Any:
        entry = table.get(key)
        if entry is None:
            raise CoordinationError(
                f"persistent worker: {what} {key} was never received here; the trainer and "
                "this worker disagree on what was sent (the worker exits and a new one starts "
                "with the next save)"
            )
        return entry

    def drop(self, segment_ids: Tuple[int, ...]) -> None:
        """Unmap a finished call's arena segments (the worker's writer thread)."""
        for sid in segment_ids:
            self._segments.pop(sid, None)


class _Unpickler(pickle.Unpickler):
    """Reads what the trainer's pickler wrote: its calls of
    :func:`~megatron_async.core.request_transport._from_table` become calls of one
    :class:`SegmentTable`'s methods."""

    def __init__(self, file, table: SegmentTable):
        super().__init__(file)
        self._table = table

    def find_class(self, module: str, name: str) -> Any:
        if module == request_transport.__name__ and name == "_from_table":
            return self._from_table
        return super().find_class(module, name)

    def _from_table(self, method: str, *args: Any) -> Any:
        return getattr(self._table, method)(*args)
