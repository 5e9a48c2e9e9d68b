"""The caller interface: run a request in the background and agree on its completion.

A caller owns the background execution of requests on one rank (trainer side):
:meth:`AsyncCaller.poll` gives that rank's view of a call, :meth:`AsyncCaller.agree`
every rank's.

Both callers' background processes report on one connection in one protocol:
:data:`STARTED` once they run, then one ``(call_idx, failure or None)`` per call
(:func:`run_call`); a process that dies mid-message reads as end of file, never as a hang.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import faulthandler
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_async.core import coordination
from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.process_lifetime import abort_at_exit
from megatron_async.core.request import (
    AsyncRequest, hand_over_staged, release_staged_data, stage_request,
)
from megatron_async.errors import (
    AsyncSaveFailedError, AsyncTimeoutError, CoordinationError, RankFailure,
)

__all__ = ["CallState", "CallStatus", "AsyncCaller", "STARTED", "run_call", "stacks_due"]

logger = logging.getLogger(__name__)

STARTED = "started"
"""A background process's first message: it runs (``fork_start_timeout_s`` is over)."""


def stacks_due(since: float, timeout_s: float) -> float:
    """When :func:`run_call` writes the stacks of a call that times out ``timeout_s`` after
    ``since`` (``time.monotonic()``, alike in every process): the smaller of 10 s and 5 %
    of ``timeout_s`` before, so that they are out before the trainer kills the writer."""
    return since + timeout_s - min(10.0, 0.05 * timeout_s)


def run_call(
    rank: int, call_idx: int, fn: Callable[..., Any], args, kwargs, due: float
) -> Tuple[int, Optional[RankFailure]]:
    """Run ``fn(*args, **kwargs)`` and return the message that says how call ``call_idx``
    ended: ``(call_idx, None)``, or ``(call_idx, the failure)`` (background side).

    If the call still runs at ``due`` (:func:`stacks_due`), every thread's stack goes to
    this process's stderr, which is the trainer's (the job's log). A timer thread writes
    them: it runs while the writer waits in a system call (a hung NFS server releases the
    interpreter lock), not while a thread holds the lock. Not faulthandler's own timer:
    in a fork of a process that armed it, arming it deadlocks.
    """
    timer = threading.Timer(max(0.0, due - time.monotonic()), _dump_stacks, (rank, call_idx))
    timer.daemon = True
    timer.start()
    try:
        fn(*args, **kwargs)
    except BaseException as exc:  # reported: the trainer raises it on every rank
        logger.error("rank %d worker: async call %d failed while writing: %s", rank, call_idx, exc)
        return call_idx, RankFailure.from_exception(rank, "write", exc)
    finally:
        timer.cancel()
    return call_idx, None


def _dump_stacks(rank: int, call_idx: int) -> None:
    """Write every thread's stack to stderr (the timer thread of :func:`run_call`)."""
    try:
        os.write(2, f"rank {rank}: async call {call_idx} is about to time out in pid "
                    f"{os.getpid()}; its threads, most recent call first:\n".encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
    except (OSError, ValueError):
        pass


class CallState(enum.Enum):
    """Local state of one call on one rank."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class CallStatus:
    """Local status of one call: its state and, when failed, why."""

    state: CallState
    failure: Optional[RankFailure] = None

    @property
    def is_terminal(self) -> bool:
        return self.state is not CallState.RUNNING

    @classmethod
    def failed(cls, failure: RankFailure) -> "CallStatus":
        return cls(CallState.FAILED, failure)


_RUNNING = CallStatus(CallState.RUNNING)
_SUCCEEDED = CallStatus(CallState.SUCCEEDED)


class AsyncCaller(abc.ABC):
    """Runs scheduled requests in the background on one rank (trainer side).

    :meth:`schedule_async_call` never raises for a failure of the request itself
    (staging, writing, a dead worker): the failure is recorded and reported by
    :meth:`poll`, so that it surfaces on every rank at finalization instead of on one.
    """

    _if_forks_hang = "use the persistent caller (one fork per job) or Python >= 3.12"
    """The advice of :meth:`_overdue` for a fork that hangs again and again."""

    def __init__(self, config: Optional[AsyncCallerConfig] = None):
        self.config = config or AsyncCallerConfig()
        self._current_call_idx: Optional[int] = None
        self._statuses: Dict[int, CallStatus] = {}  # this rank's view of each call, for poll
        self._started = False  # the background process sent STARTED
        abort_at_exit(self)

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Stage the request's data (``preload_fn``), start ``async_fn`` in the background
        and return once the data is handed over (trainer side).

        Must be called on every rank (the request may be a no-op on some). A failure to
        stage or to start is recorded for :meth:`poll`, never raised: raising here would
        leave this rank out of step. An interrupt while handing the data over abandons the
        call (:meth:`_abandon`: nothing may still write it) and propagates.
        """
        idx = async_req.call_idx
        self._current_call_idx = idx
        if async_req.async_fn is None and async_req.preload_fn is None:
            self._statuses[idx] = _SUCCEEDED
            return
        try:
            self._prepare()
        except Exception as exc:
            self._record_failure(idx, "schedule", exc)
            return
        try:
            args, staged = stage_request(async_req)
        except Exception as exc:
            self._record_failure(idx, "staging", exc)
            return
        if async_req.async_fn is None:
            release_staged_data(staged)
            self._statuses[idx] = _SUCCEEDED
            return
        try:
            pid = self._start(async_req, args, staged)
        except Exception as exc:
            release_staged_data(staged)
            self._record_failure(idx, "schedule", exc)
            return
        except BaseException:  # an interrupt: its writer may have the request already
            self._abandon(idx)  # killed: nothing reads the staged data, which is freed
            release_staged_data(staged)  # (also where no writer took it: not leaked)
            raise
        self._statuses[idx] = _RUNNING
        try:
            hand_over_staged(staged, pid)  # overlapped or in rounds: copied now
        except BaseException:  # an interrupt: the queue abandons the call, so nothing may write it
            del self._statuses[idx]
            self._abandon(idx)
            raise
        logger.debug("rank %d: async call %d runs in pid %d", coordination.get_rank(), idx, pid)

    def _read_messages(self, conn: Any) -> Tuple[List[int], bool]:
        """Apply what the background process sent on ``conn`` so far (trainer side, never
        blocks; see the module docstring for the protocol).

        Returns:
            The calls that ended, and whether the process closed its end (it exited or died).
        """
        ended = []
        try:
            while conn.poll(0):
                message = conn.recv()
                if message == STARTED:
                    self._started = True
                    continue
                idx, failure = message
                self._statuses[idx] = (
                    _SUCCEEDED if failure is None else CallStatus.failed(failure)
                )
                ended.append(idx)
        except (EOFError, OSError):
            return ended, True
        return ended, False

    def _record_failure(self, call_idx: int, phase: str, exc: Exception) -> None:
        rank = coordination.get_rank()
        logger.error("rank %d: %s of async call %d failed: %s", rank, phase, call_idx, exc)
        self._statuses[call_idx] = CallStatus.failed(RankFailure.from_exception(rank, phase, exc))

    def _overdue(self, call_idx: int, pid: Optional[int], forked_at: float, sent_at: float
                 ) -> Optional[AsyncTimeoutError]:
        """The error of call ``call_idx`` if its writer ``pid`` (killed by the caller) did not
        start within ``fork_start_timeout_s`` or ran past ``timeout_s``, else None."""
        rank, now = coordination.get_rank(), time.monotonic()
        if pid is not None and not self._started and now - forked_at > self.config.fork_start_timeout_s:
            return AsyncTimeoutError(
                f"rank {rank}: the forked writer (pid {pid}) did not start within "
                f"fork_start_timeout_s={self.config.fork_start_timeout_s:.0f}s and was killed: the "
                "fork hung in the child before running any code (CPython gh-112275, a thread "
                "starting or ending as the trainer forked, or a library's at-fork handler). The "
                f"next save forks afresh; if this repeats, {self._if_forks_hang}"
            )
        if now - sent_at > self.config.timeout_s:
            return AsyncTimeoutError(
                f"rank {rank}: async call {call_idx} ran longer than timeout_s="
                f"{self.config.timeout_s:.0f}s in background process {pid}, which was killed; "
                "check the storage for a stalled write or raise AsyncCallerConfig.timeout_s; "
                f"the writer's stacks, written just before, are in rank {rank}'s stderr"
            )
        return None

    def _prepare(self) -> None:
        """Get ready to start a call, before its data is staged (the persistent caller
        replaces a dead worker here); raises when it cannot."""

    @abc.abstractmethod
    def _start(self, async_req: AsyncRequest, args: Tuple[Any, ...], staged: Any) -> int:
        """Start ``async_fn(*args)`` in a background process and return its pid; from here
        on the caller owns ``staged`` and releases it once that process is done with it.
        Raises when it cannot start (``staged`` stays the scheduler's to release)."""

    @abc.abstractmethod
    def _abandon(self, call_idx: int) -> None:
        """Kill the process that could still write the abandoned call ``call_idx``."""

    @abc.abstractmethod
    def poll(self, call_idx: int) -> CallStatus:
        """Return the local status of call ``call_idx`` without blocking.

        Also enforces the liveness check (a dead background process fails its calls)
        and the per-call timeout (an overdue process is killed and its call fails).
        """

    def release(self, call_idx: int) -> None:
        """Forget a finalized call and reap what it used (trainer side)."""

    @abc.abstractmethod
    def close(self, abort: bool = False) -> None:
        """Stop the background processes; with ``abort``, kill them without waiting."""

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """Return whether the oldest scheduled call is done on every rank.

        Kept for API compatibility with megatron-core; :class:`AsyncCallsQueue` is the
        usual entry point. Must be called on every rank unless ``no_dist``.

        Raises:
            AsyncSaveFailedError: on every rank, when the call failed on any rank.
        """
        if self._current_call_idx is None:
            return True
        failures = self.agree(self._current_call_idx, blocking, no_dist)
        if failures:
            raise AsyncSaveFailedError(failures)
        return failures is not None

    def agree(self, call_idx: int, blocking: bool, no_dist: bool) -> Optional[Dict[int, RankFailure]]:
        """Agree with every rank whether call ``call_idx`` is finished, and whether it failed.

        Runs on every rank (unless ``no_dist``). One all-reduce (MAX) of four integers
        answers "is any rank still running?", "did any rank fail?" and "is every rank
        looking at the same call?"; only when some rank failed is a second collective used
        to gather the failures, so that every rank can raise the same complete error. A
        rank that failed counts as finished: the agreement waits until no rank is still
        running, so that no background writer is left behind when the error is raised.

        Returns:
            None while some rank still runs it (only without ``blocking``: blocking waits,
            bounded by the call's timeout); else every rank's failure of it (empty: it
            succeeded everywhere).

        Raises:
            CoordinationError: ranks are finalizing different calls, or a peer is gone.
        """
        local = no_dist or not coordination.is_distributed()
        while True:
            status = self._local_status(call_idx)
            any_running, any_failed = not status.is_terminal, status.state is CallState.FAILED
            if not local:
                any_running, any_failed, max_idx, neg_min_idx = coordination.all_reduce_max(
                    [int(any_running), int(any_failed), call_idx, -call_idx]
                )
                if max_idx != -neg_min_idx:
                    raise CoordinationError(
                        f"rank {coordination.get_rank()}: ranks are finalizing different async "
                        f"calls (indices {-neg_min_idx}..{max_idx}). Every rank must schedule the "
                        "same saves in the same order and call maybe_finalize_async_calls together."
                    )
            if not any_running:
                if not any_failed:
                    return {}
                gathered = [status.failure] if local else coordination.all_gather_objects(status.failure)
                return {f.rank: f for f in gathered if f is not None}
            if not blocking:
                return None
            time.sleep(self.config.poll_interval_s)

    def _local_status(self, call_idx: int) -> CallStatus:
        """:meth:`poll`, with an exception of the poll itself made this call's failure (every
        rank): raised here, it would skip the agreement's collective on this rank alone and
        leave the other ranks waiting in it until ``coordination_timeout_s``."""
        try:
            return self.poll(call_idx)
        except Exception as exc:
            rank = coordination.get_rank()
            logger.exception("rank %d: checking async call %d failed", rank, call_idx)
            return CallStatus.failed(RankFailure.from_exception(rank, "finalize", exc))

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """Return True when no rank reports ``is_alive`` (one gloo all-reduce)."""
        (any_alive,) = coordination.all_reduce_max([int(is_alive)])
        return not any_alive

    def _abort_at_exit(self) -> None:
        """Kill what still runs (trainer side, at interpreter exit: registered by
        :func:`~megatron_async.core.process_lifetime.abort_at_exit`)."""
        pending = [idx for idx, status in self._statuses.items() if not status.is_terminal]
        if pending:
            logger.warning(
                "rank %d: exiting with unfinalized async saves %s; they are aborted and their "
                "checkpoints stay incomplete. Call AsyncCallsQueue.close() before exiting.",
                coordination.get_rank(), pending,
            )
        self.close(abort=True)

    def __del__(self) -> None:
        try:
            self.close(abort=True)
        except Exception:  # interpreter teardown: nothing sensible left to do
            pass
