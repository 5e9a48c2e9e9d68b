"""Copies made after the hand-over: overlapped staging, and the later rounds of a larger state.

Runs in the trainer. Overlapped staging is opt-in (``TorchDistSaveConfig(overlap_staging=True)``).
Without it, scheduling a save returns once every saved tensor is copied to host memory. With
it, scheduling only borrows the host buffers and records each saved tensor's version
counter; the copy runs while the next forward/backward runs. Overlapped staging and the
later rounds of a state above the budget (:mod:`.rounds`, :mod:`.torch_save`) build a
:class:`CopyJob` at scheduling; our callers start it once the request is with its writer
(:meth:`StagedData.hand_over`), on a helper thread (:class:`CopyThread`), where it marks
each item copied on the save's gate (:mod:`.gate`); the writer waits for each item's mark
(:meth:`~.gate.StagingGate.writer_view`). Every wait for a job (scheduling's in rounds, the
next optimizer step's, the next save's before it reuses the pool) is :meth:`CopyJob.wait`,
bounded by the time the job copies nothing. CUDA sources are copied on a side stream into
page-locked memory, one bounded wait per run; after a failure their buffers live on until
the queued copies have landed.

Nothing may change a saved tensor before it is copied:

* :func:`wait_for_staging` blocks until every copy of this process is done. A global
  ``torch.optim`` step pre-hook, installed with the first overlapped save, calls it:
  the step of every torch optimizer waits, which includes the optimizers inside
  megatron-core's plain and distributed optimizers, so a megatron-core training loop
  needs nothing more. A loop that changes saved tensors in another way calls
  :func:`wait_for_staging` first;
* megatron-core's ``overlap_param_gather`` writes model parameters during the next
  forward, before any optimizer step: :func:`refuse_overlap_param_gather` refuses that
  combination (call it once with the model chunks or the optimizer);
* every watched tensor's version counter, recorded at scheduling, is checked before and
  after its copy: a saved tensor changed in between fails that save, on every rank, with
  :class:`~megatron_async.errors.StagingRaceError` naming the tensor and the fix (recorded
  on the gate; the writer raises it), instead of writing a torn checkpoint. (Writes that
  bypass autograd's version counter, e.g. through ``tensor.data``, cannot be detected.)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_async.core import coordination
from megatron_async.core.config import STAGING_WAIT_S
from megatron_async.core.device_wait import landed_after_failure, wait_for_stream
from megatron_async.core.helper_threads import HelperThreads
from megatron_async.core.one_per_process import OnePerProcess
from megatron_async.errors import AsyncTimeoutError, CheckpointValidationError, StagingRaceError
from megatron_async.staging.gate import StagingGate, wait_for_room

__all__ = [
    "CopyJob",
    "CopyThread",
    "OVERLAPPED_ADVICE",
    "StagedData",
    "refuse_overlap_param_gather",
    "wait_for_staging",
    "watch",
]

logger = logging.getLogger(__name__)

OVERLAPPED_ADVICE = (
    "Call megatron_async.staging.overlapped.wait_for_staging() before changing saved "
    "tensors (every torch optimizer's step() does it automatically), or save without "
    "overlap_staging"
)
"""What to do about a tensor changed before an overlapped copy (the race's message)."""

Watched = Tuple[Tuple[torch.Tensor, int], ...]
"""``(tensor, version at scheduling)`` of the saved tensors behind one copy."""


def watch(*tensors: torch.Tensor) -> Watched:
    """Record the version counters of ``tensors`` (an inference tensor has none: skipped)."""
    watched = []
    for tensor in tensors:
        try:
            watched.append((tensor, tensor._version))
        except RuntimeError:
            pass
    return tuple(watched)


class CopyJob:
    """One save's copies, made by the copy thread as the writer frees their bytes.

    Built by the trainer at scheduling and run (:meth:`run`) after the hand-over.

    Args:
        gate: the save's gate; each item is marked copied on it, and a failure recorded
            for the writer to raise.
        copies: ``(name, source, buffer, watched)`` per copy: ``buffer.copy_(source)``,
            with ``watched`` (see :func:`watch`) checked around it.
        indices: the gate's item index of each copy.
        waits_for: per gate item, the items whose bytes it overwrites (in rounds; none in
            one go).
        timeout_s: the bound of each wait for the writer.
        what: the staging mode, as messages name it.
        advice: what to do about a tensor changed before its copy.
    """

    def __init__(self, gate: StagingGate, copies: List[tuple], indices: List[int],
                 waits_for: Sequence[Sequence[int]], timeout_s: float = STAGING_WAIT_S,
                 what: str = "overlapped staging", advice: str = OVERLAPPED_ADVICE):
        self.gate: Optional[StagingGate] = gate
        self.copies = copies
        self.rank = coordination.get_rank()  # for messages
        self.indices = indices
        self.waits_for = waits_for
        self.timeout_s = timeout_s
        self.what = what
        self.advice = advice
        self.copied = 0
        self.submitted = False
        self.done = threading.Event()
        self.stream = None
        if any(source.device.type == "cuda" for _, source, _, _ in copies):
            # The side stream starts after the work queued so far on the current stream.
            self.stream = torch.cuda.Stream()
            self.stream.wait_stream(torch.cuda.current_stream())

    def wait(self, timeout_s: float) -> bool:
        """Wait until the job is done, for as long as it keeps copying (trainer).

        Returns:
            False when it copied nothing for ``timeout_s`` (stuck); True once done.
        """
        deadline = time.monotonic() + timeout_s
        last = self.copied
        while not self.done.wait(min(max(deadline - time.monotonic(), 0.0), 1.0)):
            if self.copied != last:  # in rounds: still copying as the writer drains
                last, deadline = self.copied, time.monotonic() + timeout_s
            elif time.monotonic() > deadline:
                return False
        return True


    def run(self) -> None:
        """Copy every tensor, run after run, marking each copied; a failure is recorded
        on the gate instead (the trainer's copy thread)."""
        gate = self.gate
        try:
            position = 0
            while position < len(self.copies):
                end = self._next_run(position)
                if end is None:
                    return  # the writer failed and reads nothing more: its error fails the save
                self._copy(position, end)
                position = self.copied = end
        except BaseException as exc:  # reported by the writer, on every rank at finalization
            self._keep_queued_copies()
            if not isinstance(exc, StagingRaceError):
                logger.error("rank %d: %s failed: %s", self.rank, self.what, exc)
                exc = f"rank {self.rank}: {self.what} failed: {type(exc).__name__}: {exc}"
            gate.fail(str(exc))
        finally:
            self.copies = []
            self.gate = None  # a live segment would keep a restarted worker from forking
            self.done.set()

    def _next_run(self, position: int) -> Optional[int]:
        """The end of the run of items from ``position`` that may be copied now: once the
        writer freed the first one's bytes (a bounded wait), it and the following ones
        already free (in one go: all of them). None: the writer is done."""
        if not wait_for_room(
            self.gate, self.waits_for[self.indices[position]], self.timeout_s,
            f"rank {self.rank}: the background writer freed no staging memory for "
            f"{self.timeout_s:.0f}s ({self.what}); the writer is stuck",
        ):
            return None
        end = position + 1
        while end < len(self.copies) and all(
                self.gate.is_written(k) for k in self.waits_for[self.indices[end]]):
            end += 1
        return end

    def _copy(self, start: int, end: int) -> None:
        """Copy items ``start:end``, checking each version before and after its copy (CUDA
        sources on the side stream's device: on that stream, checked once it is
        synchronized; on another device: a blocking copy); mark each copied once its
        bytes are in the buffers."""
        on_stream = []
        for k in range(start, end):
            name, source, buffer, watched = self.copies[k]
            self._check(name, watched)
            if source.device.type == "cuda" and source.device == self.stream.device:
                with torch.cuda.stream(self.stream):
                    buffer.copy_(source, non_blocking=True)
                on_stream.append(k)
            else:
                buffer.copy_(source)
                self._check(name, watched)  # not changed while it was copied
                self.gate.mark_copied(self.indices[k])
        if on_stream:
            wait_for_stream(self.stream, holding=[self.copies[k][2] for k in on_stream])
            for k in on_stream:
                name, _, _, watched = self.copies[k]
                self._check(name, watched)
                self.gate.mark_copied(self.indices[k])

    def _keep_queued_copies(self) -> None:
        """After a failure: the buffers live on until the queued device copies land."""
        if self.stream is not None:
            landed_after_failure(stream=self.stream, holding=[b for _, _, b, _ in self.copies])

    def _check(self, name: str, watched: Watched) -> None:
        """Raise if a watched tensor changed since scheduling."""
        for tensor, version in watched:
            now = tensor._version
            if now != version:
                raise StagingRaceError(
                    f"rank {self.rank}: saved tensor {name!r} was modified in place before "
                    f"{self.what} had copied it (version {version} -> {now}), so this save "
                    f"would mix two training steps and fails on every rank. {self.advice}"
                )


class CopyThread(OnePerProcess):
    """The copy jobs of this process not done yet, each run on a helper thread (trainer).

    The next optimizer step of the process waits for all of its jobs, so there is one
    per process (:meth:`of_process`); a forked child starts with none. Jobs run on the
    process's :class:`~megatron_async.core.helper_threads.HelperThreads`; a job that
    reuses an earlier one's buffers waits for it first (the stager's
    :func:`wait_for_staging`, the pool's :meth:`stalled`).
    """

    fresh_in_forked_child = True  # the parent's jobs do not run in the child

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: List[CopyJob] = []
        self._optimizer_hook = None

    def submit(self, job: CopyJob) -> None:
        """Start ``job`` on a helper thread (after the request's hand-over; once)."""
        with self._lock:
            if job.submitted:
                return
            job.submitted = True
            self._pending = [j for j in self._pending if not j.done.is_set()] + [job]
        HelperThreads.of_process().start(job.run, "megatron-async-staging")

    def pending(self) -> List[CopyJob]:
        """The jobs not done yet (a done job holds no buffers: :meth:`CopyJob.run`)."""
        with self._lock:
            self._pending = [job for job in self._pending if not job.done.is_set()]
            return list(self._pending)

    def stalled(self, timeout_s: float) -> Optional[CopyJob]:
        """Wait until every pending job is done; return one that copied nothing for
        ``timeout_s`` (the caller raises its own error), or None."""
        for job in self.pending():
            if not job.wait(timeout_s):
                return job
        return None

    def hook_optimizer_steps(self) -> None:
        """Make the step of every torch optimizer wait for the jobs first (a global step
        pre-hook, installed once)."""
        with self._lock:
            if self._optimizer_hook is None:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                self._optimizer_hook = register_optimizer_step_pre_hook(
                    lambda optimizer, args, kwargs: wait_for_staging()
                )


class StagedData:
    """Our staged data: the staging memory it holds, and the copies left after the hand-over
    (trainer; :class:`~.buffers.StagedBuckets`, :class:`~.torch_save.TorchSaveStaged`).

    ``loan``: this save's :class:`~.budget.Loan` of staging memory, ended by
    :meth:`release` or by the save's gate. ``copy_job``: the copies left (None: everything
    was copied at scheduling). ``scheduling_waits``: scheduling returns only once they are
    done (staging in rounds); otherwise the next optimizer step waits for them (overlapped
    staging). Our callers call its two hooks, :meth:`hand_over` and :meth:`release`
    (:func:`megatron_async.core.request.hand_over_staged`,
    :func:`~megatron_async.core.request.release_staged_data`); nothing of this travels
    when the staged data is pickled.
    """

    loan: Any = None
    copy_job: Optional[CopyJob] = None
    scheduling_waits: bool = False

    def release(self) -> None:
        """Trainer: nothing reads the staged data any more (written, failed, or its writer
        gone): end the loan (a subclass also gives back the buffers of this save alone)."""
        if self.loan is not None:
            self.loan.end()

    def hand_over(self, writer_pid: int, finish: bool = True) -> None:
        """Trainer, once the request is with its writer (after the fork, after the send):
        record the writer's process (the loan and the copy's waits end if it dies, even
        before it reads), start the copies left, and with ``finish`` wait for them where
        scheduling waits (:meth:`finish_staging`)."""
        if self.loan is not None and self.loan.gate is not None:
            self.loan.gate.record_writer(writer_pid)
        if self.copy_job is not None and self.copy_job.copies:
            CopyThread.of_process().submit(self.copy_job)
        if finish:
            self.finish_staging()

    def finish_staging(self) -> None:
        """Trainer: where scheduling waits, wait until every copy is made or the copy failed.

        The job bounds each of its waits for the writer; this wait gives up (and fails the
        save) only if the job copied nothing for longer than that bound."""
        job = self.copy_job
        if job is None or not self.scheduling_waits or not job.submitted:
            return
        gate = job.gate
        if not job.wait(job.timeout_s + 5.0):
            message = (f"rank {job.rank}: {job.what} copied nothing for {job.timeout_s:.0f}s; "
                       "the save fails (the copy thread is stuck)")
            logger.error(message)
            if gate is not None:
                gate.fail(message)


def wait_for_staging(timeout_s: float = STAGING_WAIT_S) -> None:
    """Block until every overlapped staging copy of this process is done (trainer).

    The optimizer step calls it automatically (see the module docstring); a custom loop
    calls it before changing saved tensors in any other way, and an overlapped save before
    it borrows buffers (copies run one save at a time, in order). Returns at once when no
    copy is running. A detected race is not raised here: it fails the save itself, on
    every rank, at finalization.

    Raises:
        AsyncTimeoutError: a copy made no progress for ``timeout_s`` (a copy in one go:
            did not finish within it).
    """
    job = CopyThread.of_process().stalled(timeout_s)
    if job is not None:
        raise AsyncTimeoutError(
            f"rank {job.rank}: the overlapped staging copy made no progress for "
            f"{timeout_s:.0f}s; save without overlap_staging to rule it out"
        )


def refuse_overlap_param_gather(objects: Iterable[Any]) -> None:
    """Raise if any of ``objects`` (model chunks, optimizers) gathers parameters during
    the next forward (megatron-core's ``overlap_param_gather``) (trainer, every rank).

    Those writes happen before the next optimizer step, so the automatic wait cannot
    protect the copy from them.

    Raises:
        CheckpointValidationError: ``overlap_param_gather`` is on.
    """
    for obj in objects:
        for holder in (obj, getattr(obj, "ddp_config", None), getattr(obj, "config", None)):
            if holder is not None and getattr(holder, "overlap_param_gather", False) is True:
                raise CheckpointValidationError(
                    f"overlapped checkpoint staging cannot be combined with overlap_param_gather "
                    f"({type(obj).__name__}): the parameter all-gather of the next forward would "
                    "change saved parameters before they are copied. Turn off overlap_staging "
                    "(--ckpt-overlap-staging) or overlap_param_gather"
                )
