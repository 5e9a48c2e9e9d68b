"""One long-lived worker per rank: :class:`PersistentAsyncCaller`."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional, Tuple

from megatron_async.core import coordination
from megatron_async.core.process_lifetime import describe_exit, kill_and_reap
from megatron_async.core.worker_loop import STOP
from megatron_async.core.worker_process import WorkerProcess, start_worker
from megatron_async.core.caller import AsyncCaller, CallStatus
from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.request import AsyncRequest, release_staged_data
from megatron_async.errors import (
    RankFailure,
    ReplacedReferenceAPIError,
    WorkerDiedError,
)

__all__ = ["PersistentAsyncCaller"]

logger = logging.getLogger(__name__)


class PersistentAsyncCaller(AsyncCaller):
    """Sends requests to one worker process that lives across saves (trainer side).

    The worker is a fork of the trainer (:mod:`megatron_async.core.worker_process`) that
    never runs the training script's code, so the script needs no ``__main__`` guard. The
    trainer stages each request's data itself (``preload_fn``) and sends the request
    (:mod:`megatron_async.core.request_transport`); :meth:`schedule_async_call` returns
    without waiting for the worker, and the staged data is released when the worker
    reports the call done (or is gone). A worker that dies, or is killed for overrunning a
    timeout or for not being ready within ``fork_start_timeout_s``, fails its pending calls
    on every rank, and the next save starts a fresh one; a death found between saves, and
    every replacement, is logged at WARNING.

    Args:
        config: bounds of every wait, and the worker's CPU priority.
        is_daemon: accepted for the reference API, where it makes the worker a
            multiprocessing daemon. Ours is never one: it always dies with the trainer
            (parent-death signal, exit hook), so both values behave the same.
    """

    _if_forks_hang = "use Python >= 3.12"

    def __init__(self, config: Optional[AsyncCallerConfig] = None, *, is_daemon: bool = False):
        super().__init__(config)
        self.is_daemon = bool(is_daemon)
        self.rank = coordination.get_rank()
        self.process: Optional[WorkerProcess] = None
        self._last_pid: Optional[int] = None  # of the last worker started: the next replaces it
        self._started_at = 0.0  # when the current worker was started
        self._sent_at: Dict[int, float] = {}  # call -> when it was sent: timeout_s counts from there
        self._held: Dict[int, Any] = {}  # call -> staged data and arena the worker reads
        self._closed = False
        try:
            self._start_worker()
        except WorkerDiedError as exc:
            # Not raised here: the first save tries again and fails on every rank.
            logger.error("rank %d: cannot start the persistent checkpoint worker: %s", self.rank, exc)

    # -- worker lifetime -------------------------------------------------------------

    def _start_worker(self) -> None:
        self._started = False
        self._started_at = time.monotonic()
        self.process = start_worker(self.rank, self.config)
        replaced, self._last_pid = self._last_pid, self.process.pid
        if replaced is None:
            logger.debug("rank %d: started persistent checkpoint worker pid %d", self.rank, self._last_pid)
        else:
            logger.warning(
                "rank %d: started persistent checkpoint worker pid %d to replace pid %d",
                self.rank, self._last_pid, replaced,
            )

    def _discard_worker(self, kill: bool) -> None:
        if self.process is not None:
            if kill:
                kill_and_reap(self.process, self.config.close_timeout_s)
            self.process.close_channel()
        self.process = None
        # The worker is gone: nothing reads the staged data any more.
        for idx in list(self._held):
            self._release_call(idx)

    def _release_call(self, idx: int) -> None:
        held = self._held.pop(idx, None)
        if held is not None:
            release_staged_data(held[0])

    def _fail_pending(self, make_failure) -> None:
        for idx, status in list(self._statuses.items()):
            if not status.is_terminal:
                self._statuses[idx] = CallStatus.failed(make_failure(idx))

    def _worker_died(self) -> None:
        process = self.process
        process.join(timeout=1.0)
        how = describe_exit(process.exitcode)
        if not self._started:
            how += " while starting (its traceback, if any, is on this process's stderr)"
            logger.error("rank %d: the persistent checkpoint worker (pid %d) %s",
                         self.rank, process.pid, how)
        elif not self._closed and all(status.is_terminal for status in self._statuses.values()):
            logger.warning(
                "rank %d: the persistent checkpoint worker (pid %d) %s between saves; the next "
                "save starts a new one", self.rank, process.pid, how,
            )

        def failure(idx: int) -> RankFailure:
            exc = WorkerDiedError(
                f"rank {self.rank}: persistent checkpoint worker (pid {process.pid}) {how} "
                f"while async call {idx} was pending; a new worker starts with the next save"
            )
            return RankFailure.from_exception(self.rank, "worker", exc)

        self._fail_pending(failure)
        self._discard_worker(kill=False)

    # -- messages ---------------------------------------------------------------------

    def _drain_messages(self) -> None:
        """Apply every message the worker sent so far; notice a dead worker."""
        if self.process is None:
            return
        ended, closed = self._read_messages(self.process.control)
        for idx in ended:
            self._release_call(idx)
        if closed or not self.process.is_alive():
            # Read what it managed to send before dying, then fail the rest.
            self._worker_died()

    # -- caller interface ----------------------------------------------------------------

    def _prepare(self) -> None:
        """Replace a worker that died since the last call (before staging)."""
        self._drain_messages()  # notices a worker that became ready, or died
        if self.process is None:
            try:
                self._start_worker()
            except Exception:
                self._discard_worker(kill=True)
                raise

    def _start(self, async_req: AsyncRequest, args: Tuple[Any, ...], staged: Any) -> int:
        """Send the request, its staged data as shared-memory references, to the worker."""
        idx = async_req.call_idx
        request = async_req._replace(async_fn_args=args, preload_fn=None, finalize_fns=[])
        encoded, arena = self.process.requests.encode(request)
        self._held[idx] = (staged, arena)  # before the send: the worker may read at once
        self._sent_at[idx] = time.monotonic()
        try:
            self.process.send((idx, encoded))
        except Exception:
            del self._held[idx], self._sent_at[idx]
            raise
        return self.process.pid

    def _abandon(self, call_idx: int) -> None:
        self._kill_worker("worker", WorkerDiedError(
            f"rank {self.rank}: the persistent worker was killed because scheduling async "
            f"call {call_idx} was interrupted"))

    def is_worker_ready(self) -> bool:
        """Whether the worker has started and takes the next save (trainer side, never blocks)."""
        self._drain_messages()
        return self._started

    def poll(self, call_idx: int) -> CallStatus:
        """Local status of the call; detects a dead worker and enforces the timeouts."""
        status = self._statuses.get(call_idx)
        if status is None:
            raise KeyError(f"async call {call_idx} was never scheduled on this caller")
        if status.is_terminal:
            return status
        self._drain_messages()
        status = self._statuses[call_idx]
        if status.is_terminal:
            return status
        pid = self.process.pid if self.process is not None else None
        overdue = self._overdue(call_idx, pid, self._started_at, self._sent_at[call_idx])
        if overdue is not None:
            self._kill_worker("timeout", overdue)
        return self._statuses[call_idx]

    def _kill_worker(self, phase: str, exc: Exception) -> None:
        """Fail every pending call with ``exc`` and kill the worker (the next save starts one)."""
        self._fail_pending(lambda _i: RankFailure.from_exception(self.rank, phase, exc))
        self._discard_worker(kill=True)

    def release(self, call_idx: int) -> None:
        """Forget a finalized call (the worker itself stays up)."""
        self._statuses.pop(call_idx, None)
        self._sent_at.pop(call_idx, None)

    def close(self, abort: bool = False) -> None:
        """Stop the worker: let it finish (bounded), or kill it with ``abort``."""
        if self._closed:
            return
        self._closed = True
        if self.process is None:
            return
        if abort or not self.process.is_alive():
            self._discard_worker(kill=True)
            return
        self.process.send(STOP)
        self.process.join(timeout=self.config.close_timeout_s)  # bounded: it polls
        if self.process.is_alive():
            logger.warning(
                "rank %d: persistent worker pid %d did not stop within %.0fs; killing it",
                self.rank, self.process.pid, self.config.close_timeout_s,
            )
        self._drain_messages()
        self._discard_worker(kill=True)

    @staticmethod
    def async_loop(rank: int, queue: Any, preload_q: Any, comp_q: Any, log_level: int = logging.INFO) -> None:
        """The reference API's worker main loop over three multiprocessing queues.

        It has no counterpart here: our worker receives staged tensors as shared-memory
        references, which a queue cannot carry into a running process without pickling
        every tensor.

        Raises:
            ReplacedReferenceAPIError: always (the message names what to create instead).
        """
        raise ReplacedReferenceAPIError(
            f"rank {rank}: PersistentAsyncCaller.async_loop is not how this package's worker "
            "runs: create PersistentAsyncCaller() or AsyncCallsQueue(persistent=True), which "
            "start a worker (megatron_async.core.worker_loop) and send it requests"
        )
