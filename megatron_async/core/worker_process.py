"""Start the persistent worker and talk to it (trainer side).

:class:`~megatron_async.core.persistent.PersistentAsyncCaller` starts a worker
(:func:`start_worker`) when it is created and again for the save after its worker died or
was killed. By default (``AsyncCallerConfig.worker_start="fork"``) the worker is a fork of
the trainer (:mod:`megatron_async.core.worker_fork`), ready within milliseconds. With
``worker_start="exec"``, and where the trainer cannot fork it (a live staging segment, a
failed fork), it is a fresh interpreter that imports only the worker's module
(:mod:`megatron_async.core.worker_exec`).

Channels, both Unix sockets whose worker ends the child inherits:

* *control*: messages both ways as :class:`multiprocessing.connection.Connection`
  frames (the protocol is in :mod:`megatron_async.core.worker_loop`). Trainer -> worker
  messages go through a sender thread, so scheduling a save never blocks on the worker (a
  stuck worker is caught by the bounded waits instead). A dead worker reads as EOF, never
  as a hang.
* *descriptors*: the shared-memory segments' descriptors (``SCM_RIGHTS``), see
  :mod:`megatron_async.core.request_transport`.

Until a fresh interpreter says it is ready, its stderr goes to an unlinked temporary
file, so a worker that cannot start (a broken interpreter, a failing import) is reported
with its own words (:func:`startup_failure_message`). Once ready, the worker replays that
output to the trainer's stderr and writes there directly.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Optional

from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.helper_threads import HelperThreads
from megatron_async.core.request_transport import EncodedRequest, RequestSender
from megatron_async.core.sent_objects import DESCRIPTOR_TIMEOUT_S
from megatron_async.core.worker_exec import WORKER_MODULE, current_cuda_device, exec_worker
from megatron_async.core.worker_fork import can_fork_worker, fork_worker

__all__ = [
    "WorkerProcess",
    "start_worker",
    "startup_failure_message",
]

logger = logging.getLogger(__name__)

_STARTUP_OUTPUT_CHARS = 3000
"""How much of a failed start-up's stderr goes into the error message."""

_SENDER_JOIN_TIMEOUT_S = 5.0

_CLOSED = object()


class WorkerProcess:
    """A started persistent worker and the trainer's ends of its channels (trainer side).

    ``popen`` is the :class:`subprocess.Popen` of a fresh interpreter, or anything with its
    ``pid``, ``poll()`` and ``wait(timeout)`` (a forked worker).

    Has the part of :class:`multiprocessing.Process`'s interface the callers and
    :func:`~megatron_async.core.process_lifetime.kill_and_reap` use: ``pid``,
    ``is_alive()``, ``join(timeout)``, ``exitcode``.
    """

    def __init__(
        self,
        popen: subprocess.Popen,
        control: Connection,
        descriptor_socket: socket.socket,
        startup_log: Optional[Any],
        rank: int,
        forked: bool,
    ):
        self._popen = popen
        self.forked = forked
        """Whether the worker is a fork of the trainer (it cannot use CUDA) rather than a
        fresh interpreter."""
        self.pid = popen.pid
        self.control = control
        """Receives the worker's messages (``poll``/``recv``); send with :meth:`send`."""
        self.descriptor_socket = descriptor_socket
        self.requests = RequestSender(descriptor_socket, cuda_allowed=not forked)
        """Encodes requests for this worker (it knows what this worker has mapped)."""
        self._startup_log = startup_log
        self._outbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._sender_stopped = HelperThreads.of_process().start(
            self._send_loop, f"megatron-async-sender-{rank}")

    # -- the multiprocessing.Process part -----------------------------------------------

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> Optional[int]:
        """The exit code, ``-N`` if killed by signal N, None while running."""
        return self._popen.poll()

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    # -- messages -----------------------------------------------------------------------

    def send(self, message: Any) -> None:
        """Queue ``message`` for the worker; never blocks (the sender thread writes it)."""
        self._outbox.put(message)

    def send_request(self, call_idx: int, encoded: EncodedRequest) -> None:
        """Queue request ``call_idx`` for the worker, with the trainer's CUDA device to make
        current there (none for a fork, which must not touch CUDA: the data is staged)."""
        self.send((call_idx, encoded, None if self.forked else current_cuda_device()))

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

    # -- start-up -----------------------------------------------------------------------

    def startup_finished(self) -> None:
        """Drop the start-up log once the worker is ready (it writes to our stderr now)."""
        if self._startup_log is not None:
            self._startup_log.close()
            self._startup_log = None

    def startup_output(self) -> str:
        """The end of what the worker wrote to stderr while starting ("" if unknown)."""
        log = self._startup_log
        if log is None:
            return ""
        try:
            size = os.fstat(log.fileno()).st_size
            start = max(0, size - _STARTUP_OUTPUT_CHARS)
            data = os.pread(log.fileno(), size - start, start)
        except OSError as exc:
            logger.debug("cannot read the worker's start-up output: %s", exc)
            return ""
        return data.decode("utf-8", errors="replace").strip()

    # -- end ------------------------------------------------------------------------------

    def close_channels(self) -> None:
        """Close the trainer's ends; call once the worker has exited or was killed."""
        self._outbox.put(_CLOSED)
        _shutdown(self.control.fileno())  # wakes a sender blocked on a worker that is gone
        if not self._sender_stopped.wait(_SENDER_JOIN_TIMEOUT_S):
            # Closing a descriptor another thread still writes to could hit a reused number.
            logger.warning("worker %d: sender thread did not stop; leaving its socket open", self.pid)
        else:
            self.control.close()
        self.descriptor_socket.close()
        self.startup_finished()


def _shutdown(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already disconnected
    finally:
        sock.detach()


def start_worker(rank: int, config: AsyncCallerConfig) -> WorkerProcess:
    """Start the persistent worker of ``rank`` by fork or exec; return at once (trainer side).

    The worker runs :func:`megatron_async.core.worker_loop.main` and says ``("ready",
    None)`` once it can take requests. A fork that fails falls back to a fresh
    interpreter, with a warning.

    Raises:
        WorkerDiedError: the fresh interpreter could not be started at all (no executable,
            no descriptors left). A worker that starts and then fails is reported by the
            caller, from its exit code and :meth:`WorkerProcess.startup_output`.
    """
    control, worker_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    descriptors, worker_descriptors = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    options = {
        "rank": rank,
        "parent_pid": os.getpid(),
        "log_level": logging.getLogger().getEffectiveLevel(),
        "cuda_device": None,  # set for a fresh interpreter: a fork must not touch CUDA
        "control_fd": worker_control.fileno(),
        "descriptor_fd": worker_descriptors.fileno(),
        "stderr_fd": None,  # a fork writes to the trainer's stderr from the start
        "priority": config.writer_priority.to_options(),
    }
    child, startup_log = None, None
    try:
        if config.worker_start == "fork" and can_fork_worker():
            try:
                child = fork_worker(options)
            except Exception as exc:  # no memory for the page tables, a process limit
                logger.warning(
                    "rank %d: cannot fork the persistent checkpoint worker (%s); starting a "
                    "fresh interpreter instead", rank, exc,
                )
        forked = child is not None
        if child is None:
            child, startup_log = exec_worker(options)
    except BaseException:
        control.close()
        descriptors.close()
        raise
    finally:
        worker_control.close()  # the worker has its own copies now
        worker_descriptors.close()
    descriptors.settimeout(DESCRIPTOR_TIMEOUT_S)
    return WorkerProcess(child, Connection(control.detach()), descriptors, startup_log, rank, forked)


def startup_failure_message(what: str, process: WorkerProcess) -> str:
    """Say why ``process`` did not start, with its stderr, and what to check."""
    if process.forked:  # its traceback went straight to the trainer's stderr
        return (
            f"{what}. The worker was a fork of this process; its traceback, if any, is on "
            "this process's stderr. Start it as a fresh interpreter instead "
            "(AsyncCallerConfig(worker_start='exec')), or use the temporal caller "
            "(AsyncCallsQueue(persistent=False))."
        )
    output = process.startup_output()
    said = (
        "Its stderr while starting:\n    " + "\n    ".join(output.splitlines())
        if output
        else "It wrote nothing to stderr."
    )
    return (
        f"{what}. {said}\nThe worker is a fresh interpreter ({sys.executable}) that imports "
        f"{WORKER_MODULE} with this process's sys.path; check that "
        f"`{sys.executable} -c 'import {WORKER_MODULE}'` works in this environment, or use "
        "the temporal caller (AsyncCallsQueue(persistent=False))."
    )
