"""Start the persistent worker as a fork of the trainer, and talk to it (trainer side).

:class:`~megatron_async.core.persistent.PersistentAsyncCaller` starts a worker
(:func:`start_worker`) when it is created and again for the save after its worker died
or was killed; the child runs :mod:`megatron_async.core.worker_loop`. Why a fork, and what
it costs the trainer: docs/design.md, "The first save is not a cold start". What the child
inherits, and how each is kept from costing the trainer or the checkpoint (the child's
side is :func:`megatron_async.core.worker_loop.run_child`):

* **Memory, copy-on-write.** The child discards its share of the pages of the trainer's
  private CPU tensor storages (:func:`trainer_tensor_pages`; storages held only by C++
  code are not found, and their pages stay copy-on-write). It also freezes the inherited
  objects out of its cyclic garbage collection, which would otherwise touch, and so copy,
  the whole inherited heap. The worker never reads the trainer's tensors: a request and
  its staged data reach it through its socket and shared memory.
* **Staging segments.** The child maps private zero pages over every registered segment at
  once; the address ranges stay taken, so nothing the child maps later lands where a
  stale inherited object points. A segment the worker needs it opens anew.
* **Signal handlers** the trainer installed are reset to a fresh interpreter's, so a
  trainer's handler (e.g. one that saves a checkpoint on SIGTERM) never runs in the worker.
* **Threads.** Only the forking thread exists in the child; torch's intra-op pool is set to
  one thread so the child never enters a parallel region whose threads it lost.
* **Descriptors.** The child keeps what a fresh interpreter would have: standard input
  and output, the streams of ``sys.stdout``/``sys.stderr`` and of the logging handlers,
  and its own end of its socket; every other one is pointed at ``/dev/null``. So a
  listening socket (a rendezvous store's port) is free to bind again once the trainer
  closes it, a pipe's reader sees EOF when the trainer closes its end, and the trainer's
  end of the worker's own socket is the only one: a dead worker reads as EOF in the
  trainer and a gone trainer in the worker.

The channel is that Unix socket: messages both ways as
:class:`multiprocessing.connection.Connection` frames (the protocol is in
:mod:`megatron_async.core.worker_loop`). Trainer -> worker messages go through a sender
thread, so scheduling a save never blocks on the worker (a stuck worker is caught by the
bounded waits instead).
"""

from __future__ import annotations

import gc
import itertools
import logging
import mmap
import os
import queue
import socket
import time
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_async.core import worker_loop
from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.helper_threads import HelperThreads
from megatron_async.core.request_transport import RequestSender
from megatron_async.errors import WorkerDiedError

__all__ = ["WorkerProcess", "fork_worker", "start_worker", "trainer_tensor_pages"]

logger = logging.getLogger(__name__)

MIN_RELEASED_STORAGE_BYTES = 1 << 20
"""Tensor storages at least this large have their pages released in the forked worker;
smaller ones share at most a few pages each with the trainer."""

_SENDER_JOIN_TIMEOUT_S = 5.0

_REAP_POLL_S = 0.01

_CLOSED = object()


def trainer_tensor_pages() -> Tuple[List[Tuple[int, int]], List[torch.UntypedStorage]]:
    """The whole pages inside every live private CPU tensor storage of
    :data:`MIN_RELEASED_STORAGE_BYTES` or more.

    Runs on the trainer, just before the fork. Returns the ranges, ``(start address,
    length)``, and the storages they belong to: keep the storages referenced until the
    child exists, so that no range is freed and reused by other data in between. The
    partial pages at either end are left out: they may hold other allocations, which the
    child may still touch. Shared-memory storages are skipped (a fork shares them without
    copy-on-write). Whatever mapping a range lies in, ``MADV_DONTNEED`` in the child
    drops only the child's view of it, never the trainer's data.
    """
    page = mmap.PAGESIZE
    seen = set()
    ranges: List[Tuple[int, int]] = []
    storages: List[torch.UntypedStorage] = []
    objects = gc.get_objects()
    # Filter by type in C (map/compress): a list comprehension over the hundreds of
    # thousands of objects took 60 of the scan's 130 ms in the GPT example. type(), not
    # isinstance(): the latter reads ``__class__``, which some deprecated module
    # attributes turn into a warning.
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
            if (address == 0 or size < MIN_RELEASED_STORAGE_BYTES or address in seen
                    or storage.is_shared()):
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


def fork_worker(options: Dict[str, Any]) -> int:
    """Fork the persistent worker (trainer side); return its pid at once.

    The child runs :func:`megatron_async.core.worker_loop.run_child` with ``options``.

    Raises:
        OSError: the fork failed (no memory for the page tables, a process limit).
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collection between the scan and the child's freeze
    try:
        ranges, storages = trainer_tensor_pages()
        pid = os.fork()
        if pid == 0:
            worker_loop.run_child(options, ranges)
    finally:
        if gc_was_enabled:
            gc.enable()
    del storages  # the child has dropped or is dropping its share of them
    logger.debug(
        "rank %d: forked persistent worker pid %d; it drops its share of %.0f MiB of tensor pages",
        options["rank"], pid, sum(length for _start, length in ranges) / 2**20,
    )
    return pid


class WorkerProcess:
    """A forked persistent worker and the trainer's end of its channel (trainer side).

    Has the part of :class:`multiprocessing.Process`'s interface the callers and
    :func:`~megatron_async.core.process_lifetime.kill_and_reap` use: ``pid``,
    ``is_alive()``, ``join(timeout)``, ``exitcode``. The child is a plain ``os.fork``,
    reaped by non-blocking ``waitpid`` polls, so every wait on it is bounded and no exit
    hook of ``multiprocessing`` joins it.
    """

    def __init__(self, pid: int, control: Connection, rank: int):
        self.pid = pid
        self._returncode: Optional[int] = None
        self.control = control
        """Receives the worker's messages (``poll``/``recv``); send with :meth:`send`."""
        self.requests = RequestSender()
        """Encodes requests for this worker (it knows what this worker has mapped)."""
        self._outbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._sender_stopped = HelperThreads.of_process().start(
            self._send_loop, f"megatron-async-sender-{rank}")

    # -- the multiprocessing.Process part -----------------------------------------------

    @property
    def exitcode(self) -> Optional[int]:
        """The exit code, ``-N`` if killed by signal N, None while running."""
        if self._returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, how is unknown
                self._returncode = 1
            else:
                if pid == self.pid:
                    self._returncode = os.waitstatus_to_exitcode(status)
        return self._returncode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(_REAP_POLL_S)

    # -- messages -----------------------------------------------------------------------

    def send(self, message: Any) -> None:
        """Queue ``message`` for the worker; never blocks (the sender thread writes it)."""
        self._outbox.put(message)

    def _send_loop(self) -> None:
        while True:
            message = self._outbox.get()
            if message is _CLOSED:
                return
            try:
                self.control.send(message)
            except (OSError, ValueError) as exc:
                # The worker is gone; the caller's liveness checks report it.
                logger.debug("worker %d: cannot send to it any more: %s", self.pid, exc)
                return

    def close_channel(self) -> None:
        """Close the trainer's end; call once the worker has exited or was killed."""
        self._outbox.put(_CLOSED)
        sock = socket.socket(fileno=self.control.fileno())
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a sender blocked on a worker that is gone
        except OSError:
            pass  # already disconnected
        finally:
            sock.detach()
        if not self._sender_stopped.wait(_SENDER_JOIN_TIMEOUT_S):
            # Closing a descriptor another thread still writes to could hit a reused number.
            logger.warning("worker %d: sender thread did not stop; leaving its socket open", self.pid)
        else:
            self.control.close()


def start_worker(rank: int, config: AsyncCallerConfig) -> WorkerProcess:
    """Fork the persistent worker of ``rank``; return at once (trainer side).

    The worker says ``STARTED`` once it can take requests; requests sent before
    then wait in its socket.

    Raises:
        WorkerDiedError: the fork failed (no memory for the page tables, a process limit).
            A worker that forks and then fails is reported by the caller, from its exit code.
    """
    control, worker_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    options = {
        "rank": rank,
        "parent_pid": os.getpid(),
        "control_fd": worker_control.fileno(),
        "nice_increment": config.writer_nice_increment,
        "timeout_s": config.timeout_s,
    }
    try:
        pid = fork_worker(options)
    except BaseException as exc:
        control.close()
        if isinstance(exc, OSError):
            raise WorkerDiedError(
                f"rank {rank}: cannot fork the persistent checkpoint worker ({exc}): the "
                "trainer is out of memory for the child's page tables or at its process "
                "limit; the next save tries again"
            ) from exc
        raise
    finally:
        worker_control.close()  # the worker has its own copy now
    return WorkerProcess(pid, Connection(control.detach()), rank)
