"""The unit of asynchronous work, :class:`AsyncRequest`, and the hand-over of its staged data.

Runs in the trainer (every rank). Staging that goes on after the hand-over (overlapped,
or in rounds above ``staging_memory_limit``) needs the caller to call
:func:`hand_over_staged`, which only our callers do; they stage through
:func:`run_preload`, so that :func:`require_hand_over` refuses such staging at once under
another library's queue (docs/design.md, "Callers").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from megatron_async.core import coordination
from megatron_async.errors import (
    AsyncSaveFailedError,
    FrozenRequestError,
    RankFailure,
    StagingHandOverError,
)

__all__ = [
    "AsyncRequest",
    "STAGED_ARG_INDEX",
    "SaveDetails",
    "adapt_finalize_fn",
    "finalize_step_adapter",
    "hand_over_staged",
    "release_staged_data",
    "require_hand_over",
    "run_preload",
    "run_staging_and_async_fn",
    "stage_request",
]

logger = logging.getLogger(__name__)

STAGED_ARG_INDEX = 1
"""When a request has a ``preload_fn``, its result replaces ``async_fn_args[1]``.

This is the convention of megatron-core's and nvidia-resiliency-ext's writers
(``(transform_list, write_buckets, results_queue)``-style argument tuples), kept so that
requests built by either library run on our callers and ours on theirs.
"""


finalize_step_adapter: Optional[Callable[[Callable[[], Any]], Optional[Callable[[], Any]]]] = None
"""Set by a layer above the queue to swap finalize steps it knows for its own (every rank).

``finalize_step_adapter(fn)`` returns the replacement of ``fn``, or None to keep ``fn``.
Every request is adapted when it is scheduled (:meth:`AsyncRequest.freeze`) or run
synchronously, whoever built it: :mod:`megatron_async.mcore.save_call` sets the gloo-safe
replacements of megatron-core's own steps here, so that a request built by megatron-core's
stock strategy never waits in a default-group barrier on our queue.
"""


def adapt_finalize_fn(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn``, or its replacement by :data:`finalize_step_adapter` (every rank)."""
    replacement = finalize_step_adapter(fn) if finalize_step_adapter is not None else None
    return replacement or fn


@dataclasses.dataclass(frozen=True)
class SaveDetails:
    """What the commit step of a save knows about it, for the queue's INFO line (trainer
    side, one rank). A finalize function provides it through a ``save_details()`` method
    (our strategy's commit, :class:`~megatron_async.TorchAsyncCheckpoint`'s); a request
    without one gets no line.

    Attributes:
        num_bytes: bytes this rank wrote.
        staging_bytes: the most staging memory the save held (its pool when staged in
            rounds, else its state).
        staging_rounds: how many rounds the state was staged in (1: in one go).
        plan_s: time the trainer spent planning (the first part of the stall).
        write_s: time the background write took, where the writer measures it (our
            strategy's writer, on a rank that wrote something).
        changes: on the coordinator, how many items changed since the previous save.
    """

    checkpoint: str
    num_bytes: int
    staging_bytes: int
    staging_rounds: int
    plan_s: float = 0.0
    write_s: Optional[float] = None
    changes: str = ""


class AsyncRequest(NamedTuple):
    """A save split into a background part and a synchronous finalization.

    Field names and order match megatron-core's ``AsyncRequest``, so requests move
    between the two libraries unchanged.

    Attributes:
        async_fn: runs in the background (a forked process or the persistent worker);
            None means there is nothing to write on this rank. It and its arguments may
            be defined in the training script itself: the persistent worker receives
            what it cannot import by value (cloudpickle, see
            :mod:`megatron_async.core.request_transport`).
        async_fn_args: positional arguments of ``async_fn``. With a ``preload_fn``,
            element 1 is a placeholder that the staged data replaces.
        finalize_fns: run on every rank, in order, once ``async_fn`` is done on all ranks.
        preload_fn: stages the data to host memory (a snapshot) before ``async_fn`` may
            run; every caller runs it on the trainer when the request is scheduled, so it
            is never sent to a background process.
        is_frozen: set once scheduled; finalize functions can then no longer be added.
        call_idx: position in the scheduling order, set by :class:`AsyncCallsQueue`.
    """

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...]
    finalize_fns: List[Callable[[], None]]
    async_fn_kwargs: Dict[str, Any] = {}
    preload_fn: Optional[Callable[[], Any]] = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable[[], None]) -> None:
        """Append ``fn`` to the functions run after the background part is done everywhere.

        Raises:
            FrozenRequestError: the request was already scheduled; add finalize functions
                before passing it to ``schedule_async_request``.
        """
        if self.is_frozen:
            raise FrozenRequestError(
                f"AsyncRequest {self.call_idx} is frozen (already scheduled); add finalize "
                "functions before calling AsyncCallsQueue.schedule_async_request"
            )
        self.finalize_fns.append(fn)

    def freeze(self) -> "AsyncRequest":
        """Return a copy that refuses further finalize functions, with the registered
        replacements swapped in (:data:`finalize_step_adapter`)."""
        return self._replace(is_frozen=True, finalize_fns=list(map(adapt_finalize_fn, self.finalize_fns)))

    def claim_once(self) -> None:
        """This request runs now (every rank; before anything that would abandon it): each
        finalize function that guards against a second run (a ``claim_scheduling`` method:
        our strategy's commit) records it, and raises ``FrozenRequestError`` if the
        request was scheduled or run before, the save already under way untouched."""
        for fn in self.finalize_fns:
            claim = getattr(fn, "claim_scheduling", None)
            if callable(claim):
                claim()

    def abandon(self) -> None:
        """This request will never be finalized (it failed, or was refused before it was
        scheduled): let each finalize function that holds something for it (an ``abandon``
        method: our strategy's directory claim) free it now, not when the caller's last
        reference to the request goes (every rank; never raises)."""
        for fn in self.finalize_fns:
            abandon = getattr(fn, "abandon", None)
            if callable(abandon):
                try:
                    abandon()
                except Exception:  # freeing is best effort; the save's own error is raised
                    logger.warning("abandoning finalize step %r failed", fn, exc_info=True)

    def save_details(self) -> Optional[SaveDetails]:
        """The details a finalize function provides through a ``save_details()`` method;
        None when none does."""
        for fn in self.finalize_fns:
            provide = getattr(fn, "save_details", None)
            if callable(provide):
                return provide()
        return None

    def failed_error(
        self, failures: Mapping[int, RankFailure], checkpoint: Optional[str] = None
    ) -> AsyncSaveFailedError:
        """The error every rank raises when this request failed (every rank): the type a
        finalize function names in its ``failure_error_type`` (the local checkpoint
        manager's, also nvidia-resiliency-ext's ``CheckpointingException``), else
        :class:`~megatron_async.errors.AsyncSaveFailedError`."""
        for fn in self.finalize_fns:
            error_type = getattr(fn, "failure_error_type", None)
            if error_type is not None:
                return error_type(failures, checkpoint)
        return AsyncSaveFailedError(failures, checkpoint)

    def execute_sync(self) -> None:
        """Run the whole request in the calling thread: stage, write, agree, finalize.

        Runs on every rank. Gives the same failure semantics as the asynchronous path:
        if staging or writing fails on any rank, every rank raises one
        :class:`~megatron_async.errors.AsyncSaveFailedError` and no finalize function
        runs (so no checkpoint is marked complete).

        Raises:
            FrozenRequestError: the request was scheduled or run before.
        """
        self.claim_once()
        failure: Optional[RankFailure] = None
        try:
            run_staging_and_async_fn(self)
        except Exception as exc:  # reported collectively below
            logger.error("rank %d: synchronous save failed: %s", coordination.get_rank(), exc)
            failure = RankFailure.from_exception(coordination.get_rank(), "write", exc)
        try:
            coordination.agree(failure, lambda found: self.failed_error({f.rank: f for f in found}))
        except BaseException:
            self.abandon()
            raise
        for fn in map(adapt_finalize_fn, self.finalize_fns):
            fn()


class _CallerMark(threading.local):
    depth = 0


# Per thread, with no owner to pass: ``preload_fn`` takes no arguments (megatron-core's
# request format), so the thread running it is what tells whose caller runs it.
_mark = _CallerMark()


def run_preload(preload_fn: Callable[[], Any]) -> Any:
    """Run ``preload_fn`` as one of our callers, which hand staged data over (trainer)."""
    _mark.depth += 1
    try:
        return preload_fn()
    finally:
        _mark.depth -= 1


def require_hand_over(what: str, alternative: str) -> None:
    """Refuse staging that needs :func:`hand_over_staged` outside our callers (trainer).

    Args:
        what: the staging that was asked for, as the message should name it.
        alternative: how to save without it under the caller in use.

    Raises:
        StagingHandOverError: ``preload_fn`` was not run by :func:`run_preload`.
    """
    if _mark.depth > 0:
        return
    raise StagingHandOverError(
        f"{what} continues after the request is handed to its writer, which only "
        "megatron_async's callers arrange; this request's preload_fn was run by another "
        "library's AsyncCallsQueue (megatron-core's or nvidia-resiliency-ext's). Schedule "
        f"it on megatron_async.AsyncCallsQueue, or {alternative}. Nothing was staged or "
        "written; the previous checkpoint is intact"
    )


def stage_request(request: AsyncRequest) -> Tuple[Tuple[Any, ...], Any]:
    """Run the request's ``preload_fn`` (if any) through :func:`run_preload` (trainer).

    Returns:
        ``(async_fn_args with the staged data at STAGED_ARG_INDEX, the staged data)``;
        the staged data is None without a ``preload_fn``.
    """
    args = list(request.async_fn_args or ())
    if request.preload_fn is None:
        return tuple(args), None
    staged = run_preload(request.preload_fn)
    if len(args) > STAGED_ARG_INDEX:
        args[STAGED_ARG_INDEX] = staged
    return tuple(args), staged


def release_staged_data(staged: Any) -> None:
    """Tell staged data that the background part is done with it (trainer side).

    Staged data may hold reusable buffers (ours: :class:`StagedBuckets`, whose ``release``
    makes them available to the next save); callers call this once the call is over:
    written, failed, or its process gone. Data without a ``release`` method is left alone.
    """
    release = getattr(staged, "release", None)
    if callable(release):
        release()


def hand_over_staged(staged: Any, writer_pid: int, finish: bool = True) -> None:
    """Start what staging left for after the hand-over (trainer, once the request is with
    its writer: after the fork, after the send). Staged data without a ``hand_over``
    method (ours: :class:`~megatron_async.staging.overlapped.StagedData`) is left alone.

    Args:
        staged: what ``preload_fn`` returned.
        writer_pid: the process that reads the staged data (the forked child, the
            persistent worker, this process for a synchronous write); staged data that
            watches its writer records it, so that its waits end when that process dies,
            even before it started reading.
        finish: wait until staged data whose later rounds copy beside the writer is
            whole, so that the trainer changes no saved tensor before it is copied. False
            where the writer runs after this in the same thread.
    """
    hand_over = getattr(staged, "hand_over", None)
    if callable(hand_over):
        hand_over(writer_pid, finish)


def run_staging_and_async_fn(request: AsyncRequest) -> None:
    """Stage (``preload_fn``) and then run ``async_fn``, in the calling process."""
    args, staged = stage_request(request)
    hand_over_staged(staged, os.getpid(), finish=False)
    try:
        if request.async_fn is not None:
            request.async_fn(*args, **(request.async_fn_kwargs or {}))
    finally:
        release_staged_data(staged)
