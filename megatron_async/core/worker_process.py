"""Start the persistent worker and talk to it (trainer side).

:class:`~megatron_async.core.persistent.PersistentAsyncCaller` starts a worker
(:func:`start_worker`, a fork of the trainer: :mod:`megatron_async.core.worker_fork`)
when it is created and again for the save after its worker died or was killed.

The channel is a Unix socket whose worker end the child inherits: messages both ways as
:class:`multiprocessing.connection.Connection` frames (the protocol is in
:mod:`megatron_async.core.worker_loop`). Trainer -> worker messages go through a sender
thread, so scheduling a save never blocks on the worker (a stuck worker is caught by the
bounded waits instead). A dead worker reads as EOF, never as a hang.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import time
from multiprocessing.connection import Connection
from typing import Any, Optional

from megatron_async.core import stack_dump
from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.helper_threads import HelperThreads
from megatron_async.core.request_transport import RequestSender
from megatron_async.core.worker_fork import fork_worker
from megatron_async.errors import WorkerDiedError

__all__ = ["WorkerProcess", "start_worker"]

logger = logging.getLogger(__name__)

_SENDER_JOIN_TIMEOUT_S = 5.0

_REAP_POLL_S = 0.01

_CLOSED = object()


class WorkerProcess:
    """A forked persistent worker and the trainer's end of its channel (trainer side).

    Has the part of :class:`multiprocessing.Process`'s interface the callers and
    :func:`~megatron_async.core.process_lifetime.kill_and_reap` use: ``pid``,
    ``is_alive()``, ``join(timeout)``, ``exitcode``. The child is a plain ``os.fork``,
    reaped by non-blocking ``waitpid`` polls, so every wait on it is bounded and no exit
    hook of ``multiprocessing`` joins it.
    """

    def __init__(self, pid: int, control: Connection, stack_file, rank: int):
        self.pid = pid
        self.stack_file = stack_file
        """Where the worker writes its stacks when asked (:mod:`~megatron_async.core.stack_dump`)."""
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

    # -- end ------------------------------------------------------------------------------

    def close_channel(self) -> None:
        """Close the trainer's end; call once the worker has exited or was killed."""
        self._outbox.put(_CLOSED)
        _shutdown(self.control.fileno())  # wakes a sender blocked on a worker that is gone
        if not self._sender_stopped.wait(_SENDER_JOIN_TIMEOUT_S):
            # Closing a descriptor another thread still writes to could hit a reused number.
            logger.warning("worker %d: sender thread did not stop; leaving its socket open", self.pid)
        else:
            self.control.close()


def _shutdown(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already disconnected
    finally:
        sock.detach()


def start_worker(rank: int, config: AsyncCallerConfig) -> WorkerProcess:
    """Fork the persistent worker of ``rank``; return at once (trainer side).

    The worker runs :func:`megatron_async.core.worker_loop.main` and says ``("ready",
    None)`` once it can take requests; requests sent before then wait in its socket.

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
        "stack_file": stack_dump.new_file(),
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
    return WorkerProcess(pid, Connection(control.detach()), options["stack_file"], rank)
