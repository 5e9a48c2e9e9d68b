"""A forked process per save: :class:`TemporalAsyncCaller`."""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.multiprocessing as mp

from megatron_async.core import coordination
from megatron_async.core.process_lifetime import describe_exit, enter_background, kill_and_reap
from megatron_async.core.caller import STARTED, AsyncCaller, CallStatus, run_call, stacks_due
from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.device_wait import wait_for_device_copies
from megatron_async.core.request import AsyncRequest, release_staged_data
from megatron_async.errors import RankFailure, WorkerDiedError

__all__ = ["TemporalAsyncCaller"]

logger = logging.getLogger(__name__)


def _synchronize_cuda_if_used() -> None:
    """Let the device-to-host copies queued on the current device's current stream land
    before forking, bounded (only when CUDA is in use; staging already waited for its own)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        wait_for_device_copies([torch.device("cuda", torch.cuda.current_device())])


def _run_forked_call(
    result_conn, rank: int, parent_pid: int, nice_increment: int, due: float, fn,
    args: Sequence[Any], kwargs, call_idx: int,
):
    """Body of the forked child (background side): run ``fn`` and report how it ended."""
    enter_background(parent_pid, nice_increment)
    result_conn.send(STARTED)  # the fork did not hang (AsyncCallerConfig.fork_start_timeout_s)
    # The child shares the trainer's heap copy-on-write, including tensor objects whose
    # storage (CUDA memory, pinned buffers, shared memory) belongs to the trainer. A
    # garbage collection here could run their destructors: freeing CUDA memory from a
    # forked child crashes it, and touching every object dirties shared pages, which
    # copies them. Nothing the child allocates needs cycle collection before it exits.
    gc.disable()
    try:
        result_conn.send(run_call(rank, call_idx, fn, args, kwargs, due))
    finally:
        result_conn.close()


class TemporalAsyncCaller(AsyncCaller):
    """Runs one request in a freshly forked process (trainer side).

    The trainer stages the data itself (``preload_fn``) and then forks; the child
    inherits the staged snapshot (our staging buffers are shared memory, which a fork
    does not write-protect), writes it and exits. The staged data is released for reuse
    once the child is gone. A fork costs little and nothing needs to be pickled, but each
    save pays for a new process, and while the child lives the trainer's own private
    memory is copy-on-write (its first in-place update of each page copies the page).
    One instance serves one call; :class:`AsyncCallsQueue` creates one per request.
    """

    def __init__(self, config: Optional[AsyncCallerConfig] = None):
        super().__init__(config)
        self.process: Optional[mp.Process] = None
        self._result_conn = None
        self._forked_at = 0.0
        self._staged: Any = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if self.process is not None:
            raise RuntimeError("a TemporalAsyncCaller runs exactly one call; create a new one")
        super().schedule_async_call(async_req)

    def _start(self, async_req: AsyncRequest, args: Tuple[Any, ...], staged: Any) -> int:
        """Fork the child that runs ``async_fn``; it inherits the staged snapshot."""
        _synchronize_cuda_if_used()
        ctx = mp.get_context("fork")
        result_conn, child_conn = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_run_forked_call,
            args=(
                child_conn, coordination.get_rank(), os.getpid(), self.config.writer_nice_increment,
                stacks_due(time.monotonic(), self.config.timeout_s), async_req.async_fn, args,
                async_req.async_fn_kwargs or {}, async_req.call_idx,
            ),
            name=f"megatron-async-save-{async_req.call_idx}",
            daemon=False,  # a daemon could not start the writer's own I/O processes
        )
        process.start()
        self._forked_at = time.monotonic()
        child_conn.close()
        self.process, self._result_conn = process, result_conn
        self._staged = staged
        return process.pid

    def _abandon(self, call_idx: int) -> None:
        self.close(abort=True)

    def poll(self, call_idx: int) -> CallStatus:
        """Local status of the call; detects a dead child and enforces the timeout."""
        status = self._statuses[call_idx]
        if status.is_terminal:
            return status
        rank = coordination.get_rank()
        alive = self.process.is_alive()  # before reading: a child that reported, then exited, is read
        _, closed = self._read_messages(self._result_conn)
        if self._statuses[call_idx].is_terminal:  # it reported
            status = self._statuses[call_idx]
        elif closed or not alive:
            status = CallStatus.failed(self._died_failure(rank))
        else:
            overdue = self._overdue(call_idx, self.process.pid, self._forked_at, self._forked_at)
            if overdue is not None:
                kill_and_reap(self.process)
                status = CallStatus.failed(RankFailure.from_exception(rank, "timeout", overdue))
        self._statuses[call_idx] = status
        return status

    def _died_failure(self, rank: int) -> RankFailure:
        self.process.join(timeout=1.0)
        exc = WorkerDiedError(
            f"rank {rank}: background save process (pid {self.process.pid}) "
            f"{describe_exit(self.process.exitcode)} before "
            "reporting a result (out of memory? killed by the OS?)"
        )
        return RankFailure.from_exception(rank, "worker", exc)

    def release(self, call_idx: int) -> None:
        """Join the finished child (bounded) so it leaves no zombie."""
        self.close(abort=False)

    def close(self, abort: bool = False) -> None:
        """Join the child; kill it first when ``abort`` or when it outlives the bound.

        The staged data is released only after the child is reaped: until then it may
        still be reading the buffers.
        """
        process = self.process
        if process is not None:
            if abort:
                kill_and_reap(process, self.config.close_timeout_s)
            else:
                process.join(timeout=self.config.close_timeout_s)
                if process.is_alive():
                    logger.warning("background save pid %d did not exit; killing it", process.pid)
                    kill_and_reap(process)
            self._result_conn.close()  # set with the process
            self._result_conn = None
            self.process = None
        staged, self._staged = self._staged, None
        release_staged_data(staged)
