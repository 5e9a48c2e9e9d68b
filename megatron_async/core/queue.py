"""The training loop's entry point: :class:`AsyncCallsQueue`, and its one INFO line per
finalized save (every rank)."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Deque, List, NamedTuple, Optional

from megatron_async.core import coordination
from megatron_async.core.caller import AsyncCaller
from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.persistent import PersistentAsyncCaller
from megatron_async.core.request import AsyncRequest, SaveDetails
from megatron_async.core.temporal import TemporalAsyncCaller
from megatron_async.errors import AsyncSaveFailedError, CheckpointValidationError, QueueClosedError

__all__ = ["AsyncCallsQueue"]

logger = logging.getLogger(__name__)


class _ActiveAsyncRequest(NamedTuple):
    """A scheduled call: its index, the caller running it, the request to finalize and
    how long scheduling it took (for the save's INFO line)."""

    idx: int
    async_caller: AsyncCaller
    async_request: AsyncRequest
    schedule_s: float = 0.0


def log_finalized_save(
    call_idx: int, schedule_s: float, finalize_s: float, details: Optional[SaveDetails]
) -> None:
    """Log the INFO line of one finalized save: the stall (planning + ``schedule_s``, the
    staging), the bytes written (with the background write's time and rate where the
    writer measured it), the staging peak, and ``finalize_s`` (every rank). A request
    without :class:`SaveDetails` (megatron-core's own) cannot name its save: no line."""
    if details is None or not logger.isEnabledFor(logging.INFO):
        return
    d = details
    written = f"{d.num_bytes} bytes"
    if d.write_s:  # unmeasured (None) or too short to give a rate
        rate = d.num_bytes / max(d.write_s, 1e-9) / 1e9
        written = f"background write {d.write_s:.3f}s, {written} at {rate:.2f} GB/s"
    parts = [
        f"stall {d.plan_s + schedule_s:.3f}s (plan {d.plan_s:.3f}s + staging {schedule_s:.3f}s)",
        written,
        f"staging peak {d.staging_bytes} bytes in {d.staging_rounds} round(s)",
        f"finalize {finalize_s:.3f}s",
    ]
    if d.changes:
        parts.append(d.changes)
    logger.info(
        "rank %d: async call %d finalized (%s): %s",
        coordination.get_rank(), call_idx, d.checkpoint, ", ".join(parts),
    )


def as_async_request(request: Any) -> AsyncRequest:
    """Accept our :class:`AsyncRequest` or any request with the same fields (megatron-core's).

    Raises:
        TypeError: ``request`` is not an async request.
    """
    if isinstance(request, AsyncRequest):
        return request
    fields = getattr(type(request), "_fields", None)
    if fields is not None and tuple(fields[: len(AsyncRequest._fields)]) == AsyncRequest._fields:
        return AsyncRequest(*tuple(request)[: len(AsyncRequest._fields)])
    raise TypeError(
        f"schedule_async_request expects an AsyncRequest, got {type(request).__name__}; build "
        "one with megatron_async.AsyncRequest(async_fn, async_fn_args, finalize_fns, ...)"
    )


class AsyncCallsQueue:
    """Schedules saves in the background and finalizes them, in order, on every rank.

    Typical use in a training loop (every rank)::

        queue = AsyncCallsQueue(persistent=True)
        for step in ...:
            queue.maybe_finalize_async_calls(blocking=False)
            train_step()
            if step % save_interval == 0:
                queue.schedule_async_request(request)
        queue.close()

    Args:
        persistent: run saves in one long-lived worker per rank
            (:class:`PersistentAsyncCaller`) instead of a forked process per save
            (:class:`TemporalAsyncCaller`).
        config: timeouts, polling pace and the background processes' CPU and I/O
            priority; see :class:`AsyncCallerConfig`.
        is_daemon: passed to :class:`PersistentAsyncCaller` (accepted for the reference
            API; our worker behaves the same either way).

    Constructing the queue in a distributed job creates the gloo coordination group if
    it does not exist yet, which ranks may do at different points
    (:func:`~megatron_async.core.coordination.get_coordination_group`).
    """

    def __init__(
        self,
        persistent: bool = False,
        *,
        config: Optional[AsyncCallerConfig] = None,
        is_daemon: bool = False,
    ):
        if config is not None and not isinstance(config, AsyncCallerConfig):
            raise CheckpointValidationError(
                f"config must be an AsyncCallerConfig, got {type(config).__name__}; pass e.g. "
                "AsyncCallsQueue(config=AsyncCallerConfig(timeout_s=1800))"
            )
        self.persistent = persistent
        self.config = config or AsyncCallerConfig()
        self.call_idx = -1
        self.async_calls: Deque[_ActiveAsyncRequest] = deque()
        self._closed = False
        coordination.get_coordination_group(self.config.coordination_timeout_s)
        self.persistent_caller: Optional[PersistentAsyncCaller] = (
            PersistentAsyncCaller(self.config, is_daemon=is_daemon) if persistent else None
        )

    def _get_async_caller(self) -> AsyncCaller:
        if self.persistent_caller is not None:
            return self.persistent_caller
        return TemporalAsyncCaller(self.config)

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request`` in the background; return its call index.

        Runs on every rank, which must schedule the same requests in the same order.
        Returns once the request's data is staged: changing the saved tensors after
        this returns does not change the checkpoint. A failure of the request itself
        (staging, writing, a dead worker) is not raised here but by
        :meth:`maybe_finalize_async_calls`, on every rank.

        Raises:
            QueueClosedError: the queue was closed.
            FrozenRequestError: this request was scheduled before (a finalize
                function with ``claim_scheduling``, such as our strategy's commit, says so);
                the save already scheduled is untouched.
            TypeError: ``async_request`` is not an async request.
        """
        request = as_async_request(async_request)
        request.claim_once()  # before anything that would abandon the request
        if self._closed:
            request.abandon()
            raise QueueClosedError(
                "this AsyncCallsQueue is closed; create a new AsyncCallsQueue to save again"
            )
        self.call_idx += 1
        request = request._replace(call_idx=self.call_idx).freeze()
        start = time.monotonic()
        caller = self._get_async_caller()
        try:
            caller.schedule_async_call(request._replace(finalize_fns=[]))  # they stay here
        except BaseException:  # an interrupt while staging, a caller's bug: never scheduled
            request.abandon()  # frees what its steps hold (our commit step's directory claim)
            raise
        schedule_s = time.monotonic() - start
        logger.debug(
            "rank %d: scheduled async call %d in %.3fs", coordination.get_rank(), self.call_idx, schedule_s
        )
        self.async_calls.append(_ActiveAsyncRequest(self.call_idx, caller, request, schedule_s))
        return self.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize, in scheduling order, every call that is done on all ranks.

        Runs on every rank. Each check costs one small gloo all-reduce (none with
        ``no_dist``). A call is finalized (its finalize functions run on every rank)
        only when it is done everywhere; the first call still running somewhere stops
        the scan.

        Args:
            blocking: wait until every scheduled call is finalized (bounded: a dead or
                overdue background process fails its call).
            no_dist: only look at this rank's own calls, with no collective; finalize
                functions must then not need the other ranks either.

        Returns:
            Indices of the calls finalized by this invocation, in order.

        Raises:
            AsyncSaveFailedError: on every rank, when the oldest unfinished call failed on
                any rank. That call is dropped; the queue stays usable.
            CoordinationError: the ranks disagree on the calls or a peer is gone.
        """
        finalized: List[int] = []
        while self.async_calls:
            idx, caller, request, schedule_s = self.async_calls[0]
            failures = caller.agree(idx, blocking, no_dist)
            if failures is None:
                break
            self.async_calls.popleft()
            caller.release(idx)
            if failures:
                details = request.save_details()  # its checkpoint is named in the error's headline
                checkpoint = details.checkpoint if details is not None else None
                error = request.failed_error(failures, checkpoint)
                # Free the request's resources (an in-flight directory claim) now: the
                # caller may still hold the request, and the traceback keeps this frame.
                request.abandon()
                del request, caller
                raise error
            start = time.monotonic()
            for finalize_fn in request.finalize_fns:
                finalize_fn()
            finalize_s = time.monotonic() - start
            log_finalized_save(idx, schedule_s, finalize_s, request.save_details())
            finalized.append(idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        """Number of scheduled calls not finalized yet."""
        return len(self.async_calls)

    def close(self, abort: bool = False) -> None:
        """Finalize everything (blocking) and stop the background processes.

        Runs on every rank. With ``abort``, pending calls are dropped without
        finalization (their checkpoints stay incomplete) and background processes are
        killed at once, with no collective: use it on an error path. After ``close``,
        scheduling raises :class:`QueueClosedError`.
        """
        if self._closed:
            return
        self._closed = True
        first_failure: Optional[AsyncSaveFailedError] = None
        try:
            while not abort and self.async_calls:
                try:
                    self.maybe_finalize_async_calls(blocking=True)
                except AsyncSaveFailedError as exc:  # keep finalizing the later calls
                    first_failure = first_failure or exc
        finally:
            for active in self.async_calls:
                active.async_caller.close(abort=True)
                active.async_request.abandon()
            self.async_calls.clear()
            if self.persistent_caller is not None:
                self.persistent_caller.close(abort=abort)
        if first_failure is not None:
            raise first_failure

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and self.async_calls:
            logger.warning(
                "AsyncCallsQueue garbage-collected with %d unfinalized call(s); they are aborted",
                len(self.async_calls),
            )
            self.close(abort=True)
