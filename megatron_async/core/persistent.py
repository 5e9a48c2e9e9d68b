"""One long-lived worker per rank: :class:`PersistentAsyncCaller`."""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import time
from multiprocessing.reduction import ForkingPickler
from typing import Dict, Optional, Set

import torch
import torch.multiprocessing as mp

from megatron_async.core import coordination
from megatron_async.core._process import kill_and_reap, raise_open_file_limit, register_exit_cleanup
from megatron_async.core._worker_loop import STOP, persistent_worker_main
from megatron_async.core.caller import AsyncCaller, CallStatus
from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.request import AsyncRequest
from megatron_async.errors import AsyncTimeoutError, RankFailure, WorkerDiedError

__all__ = ["PersistentAsyncCaller"]

logger = logging.getLogger(__name__)

_WORKER_ENV = "MEGATRON_ASYNC_BACKGROUND_WORKER"  # same name as megatron_async.BACKGROUND_WORKER_ENV


class _StorageCounter(pickle.Pickler):
    """Counts the distinct CPU tensor storages a request would share, without sharing them."""

    def __init__(self):
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: Set[int] = set()

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and obj.numel():
                self.storages.add(obj.untyped_storage().data_ptr())
            return torch.empty, (0,)
        return NotImplemented


def _check_descriptors_suffice(request: AsyncRequest, rank: int) -> None:
    """Refuse, before pickling, a request whose tensors need more descriptors than allowed.

    torch shares each CPU tensor storage with the worker through a file descriptor that
    the trainer keeps open for the storage's lifetime. Pickling a request past the limit
    fails halfway and leaks the descriptors already duplicated, after which the trainer
    cannot open files at all; counting first turns that into a clear error.
    """
    counter = _StorageCounter()
    counter.dump(request)
    needed = len(counter.storages)
    limit = raise_open_file_limit()
    open_now = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    if open_now + 2 * needed + 64 > limit:
        raise OSError(
            errno.EMFILE,
            f"rank {rank}: this save shares {needed} CPU tensor storages with the persistent "
            f"worker, which needs about {2 * needed} file descriptors, but only {limit - open_now} "
            "are available (ulimit -n). Raise the hard limit of open files, or use the temporal "
            "caller (AsyncCallsQueue(persistent=False)), which shares nothing",
        )


def _current_cuda_device() -> Optional[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


class PersistentAsyncCaller(AsyncCaller):
    """Sends requests to one spawned worker process that lives across saves (trainer side).

    The worker is started when the caller is created (so its start-up overlaps with
    training), stages each request's data (``preload_fn``) and acknowledges, then writes
    on a separate thread. The trainer returns from :meth:`schedule_async_call` as soon as
    the acknowledgement arrives. If the worker dies or overruns a timeout, its pending
    calls fail (on every rank, at finalization) and the next save starts a fresh worker.

    Like any spawn-based multiprocessing, the training script needs an
    ``if __name__ == "__main__":`` guard.
    """

    def __init__(self, config: Optional[AsyncCallerConfig] = None):
        super().__init__(config)
        self.rank = coordination.get_rank()
        self.process: Optional[mp.Process] = None
        self._requests = None
        self._results = None
        self._statuses: Dict[int, CallStatus] = {}
        self._start_times: Dict[int, float] = {}
        self._staged: set = set()
        self._closed = False
        register_exit_cleanup(self, "_abort_at_exit")
        self._start_worker()

    # -- worker lifetime -------------------------------------------------------------

    def _start_worker(self) -> None:
        ctx = mp.get_context("spawn")
        self._requests = ctx.Queue()
        self._results, child_conn = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=persistent_worker_main,
            args=(
                self.rank,
                self._requests,
                child_conn,
                os.getpid(),
                logging.getLogger().getEffectiveLevel(),
                _current_cuda_device(),
            ),
            name=f"megatron-async-worker-{self.rank}",
            daemon=False,  # a daemon could not start the writer's own I/O processes
        )
        # The worker inherits the environment at start: tell the package it is a worker.
        previous = os.environ.get(_WORKER_ENV)
        os.environ[_WORKER_ENV] = "1"
        try:
            self.process.start()
        finally:
            if previous is None:
                del os.environ[_WORKER_ENV]
            else:
                os.environ[_WORKER_ENV] = previous
        child_conn.close()
        logger.debug("rank %d: started persistent checkpoint worker pid %d", self.rank, self.process.pid)

    def _discard_worker(self, kill: bool) -> None:
        if self.process is not None and kill:
            kill_and_reap(self.process, self.config.close_timeout_s)
        if self._requests is not None:
            self._requests.cancel_join_thread()
            self._requests.close()
        if self._results is not None:
            self._results.close()
        self.process, self._requests, self._results = None, None, None

    def _fail_pending(self, make_failure) -> None:
        for idx, status in list(self._statuses.items()):
            if not status.is_terminal:
                self._statuses[idx] = CallStatus.failed(make_failure(idx))

    def _worker_died(self) -> None:
        process = self.process
        process.join(timeout=1.0)
        code = process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"

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
        if self._results is None:
            return
        try:
            while self._results.poll(0):
                message = self._results.recv()
                kind, idx = message[0], message[1]
                if kind == "done":
                    self._statuses[idx] = CallStatus.succeeded()
                elif kind == "error":
                    self._statuses[idx] = CallStatus.failed(message[2])
                elif kind == "staged":
                    self._statuses.setdefault(idx, CallStatus.running())
                    self._staged.add(idx)
        except (EOFError, OSError):
            self._worker_died()
            return
        if self.process is not None and not self.process.is_alive():
            # Read what it managed to send before dying, then fail the rest.
            self._worker_died()

    # -- caller interface ----------------------------------------------------------------

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Send the request to the worker and wait (bounded) until its data is staged.

        Runs on every rank. Failures (unpicklable request, staging error, worker death,
        staging timeout) are recorded for :meth:`poll`, never raised here.
        """
        idx = async_req.call_idx
        self._current_call_idx = idx
        self._start_times[idx] = time.monotonic()
        if async_req.async_fn is None and async_req.preload_fn is None:
            self._statuses[idx] = CallStatus.succeeded()
            return
        if self.process is None or not self.process.is_alive():
            if self.process is not None:
                self._worker_died()
            try:
                self._start_worker()
            except Exception as exc:  # recorded: raising here would leave this rank out of step
                logger.error("rank %d: cannot start the persistent worker: %s", self.rank, exc)
                self._discard_worker(kill=True)
                self._statuses[idx] = CallStatus.failed(RankFailure.from_exception(self.rank, "schedule", exc))
                return
        try:
            request = async_req.without_finalize_fns()
            _check_descriptors_suffice(request, self.rank)
            payload = bytes(ForkingPickler.dumps(request))
        except Exception as exc:
            logger.error("rank %d: async call %d cannot be sent to the worker: %s", self.rank, idx, exc)
            self._statuses[idx] = CallStatus.failed(RankFailure.from_exception(self.rank, "schedule", exc))
            return
        self._statuses[idx] = CallStatus.running()
        self._requests.put((idx, payload, _current_cuda_device()))
        del payload
        self._wait_until_staged(idx)

    def _wait_until_staged(self, idx: int) -> None:
        deadline = time.monotonic() + self.config.staging_timeout_s
        while True:
            self._drain_messages()
            status = self._statuses[idx]
            if idx in self._staged or status.is_terminal:
                self._staged.discard(idx)
                # timeout_s bounds the background part; staging (worker start-up
                # included) has its own bound, staging_timeout_s.
                self._start_times[idx] = time.monotonic()
                return
            if time.monotonic() > deadline:
                pid = self.process.pid if self.process is not None else None
                exc = AsyncTimeoutError(
                    f"rank {self.rank}: persistent worker (pid {pid}) did not finish staging "
                    f"async call {idx} within staging_timeout_s={self.config.staging_timeout_s:.0f}s; "
                    "it was killed and a new one starts with the next save"
                )
                self._kill_worker_after_timeout(exc)
                return
            time.sleep(min(self.config.poll_interval_s, 0.005))

    def poll(self, call_idx: int) -> CallStatus:
        """Local status of the call; detects a dead worker and enforces the timeout."""
        status = self._statuses.get(call_idx)
        if status is None:
            raise KeyError(f"async call {call_idx} was never scheduled on this caller")
        if status.is_terminal:
            return status
        self._drain_messages()
        status = self._statuses[call_idx]
        if not status.is_terminal and time.monotonic() - self._start_times[call_idx] > self.config.timeout_s:
            pid = self.process.pid if self.process is not None else None
            exc = AsyncTimeoutError(
                f"rank {self.rank}: async call {call_idx} ran longer than timeout_s="
                f"{self.config.timeout_s:.0f}s in persistent worker (pid {pid}), which was killed; "
                "check the storage for a stalled write or raise AsyncCallerConfig.timeout_s"
            )
            self._kill_worker_after_timeout(exc)
            status = self._statuses[call_idx]
        return status

    def _kill_worker_after_timeout(self, exc: AsyncTimeoutError) -> None:
        """Fail every pending call with ``exc`` and kill the worker (the next save starts one)."""
        self._fail_pending(lambda _i: RankFailure.from_exception(self.rank, "timeout", exc))
        self._discard_worker(kill=True)

    def release(self, call_idx: int) -> None:
        """Forget a finalized call (the worker itself stays up)."""
        self._statuses.pop(call_idx, None)
        self._start_times.pop(call_idx, None)

    def close(self, abort: bool = False) -> None:
        """Stop the worker: let it finish accepted writes (bounded), or kill it with ``abort``."""
        if self._closed:
            return
        self._closed = True
        if self.process is None:
            return
        if abort or not self.process.is_alive():
            self._discard_worker(kill=True)
            return
        self._requests.put(STOP)
        deadline = time.monotonic() + self.config.close_timeout_s
        while time.monotonic() < deadline and self.process.is_alive():
            self.process.join(timeout=self.config.poll_interval_s)
        if self.process.is_alive():
            logger.warning(
                "rank %d: persistent worker pid %d did not stop within %.0fs; killing it",
                self.rank, self.process.pid, self.config.close_timeout_s,
            )
        self._drain_messages()
        self._discard_worker(kill=True)

    def _abort_at_exit(self) -> None:
        pending = [i for i, s in self._statuses.items() if not s.is_terminal]
        if pending:
            logger.warning(
                "rank %d: exiting with unfinalized async saves %s; they are aborted and their "
                "checkpoints stay incomplete. Call AsyncCallsQueue.close() before exiting.",
                self.rank, pending,
            )
        self.close(abort=True)
