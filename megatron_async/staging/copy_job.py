"""One save's staging copy after the hand-over: the same job in every mode that copies late.

Runs in the trainer, on a thread of its own: the overlapped copy thread
(:mod:`.overlapped`, in one go or in rounds) or the rounds copy thread that scheduling
waits for (:mod:`.rounds`). A :class:`CopyJob` copies its tensors in runs:

* in one go, every tensor in one run, then the save's gate is marked staged (the writer
  waits for that mark before it writes a byte);
* in rounds (the staging budget's pool), each run once the writer wrote the items whose
  bytes it overwrites (a bounded wait on the gate), each item marked copied on the gate
  once its bytes are in the pool.

Every source's version counter, recorded at scheduling, is checked before and after its
copy: a tensor changed in between fails the save on every rank
(:class:`~megatron_async.errors.StagingRaceError`, recorded on the gate; the writer raises
it). CUDA sources are copied on a side stream into page-locked memory, one bounded wait
per run; after a failure their buffers live on until the queued copies have landed.
"""

from __future__ import annotations

import logging
import threading
from typing import List, Optional, Sequence

import torch

from megatron_async.core.device_wait import landed_after_failure, wait_for_stream
from megatron_async.errors import StagingRaceError
from megatron_async.staging.gate import DEFAULT_STAGING_WAIT_S, StagingGate, wait_for_room

__all__ = ["CopyJob", "OVERLAPPED_ADVICE"]

logger = logging.getLogger(__name__)

OVERLAPPED_ADVICE = (
    "Call megatron_async.staging.overlapped.wait_for_staging() before changing saved "
    "tensors (every torch optimizer's step() does it automatically), or save without "
    "overlap_staging"
)
"""What to do about a tensor changed before an overlapped copy (the race's message)."""


class CopyJob:
    """One save's copies, made in one go or in rounds by one trainer thread.

    Built by the trainer at scheduling and run (:meth:`run`) after the hand-over.

    Args:
        gate: the save's gate; a failure is recorded on it for the writer to raise.
        copies: ``(name, source, buffer, version at scheduling or None)`` per tensor.
        rank: this rank, for messages.
        indices: in rounds, the gate's item index of each copy (None: in one go).
        waits_for: in rounds, per gate item, the items whose bytes it overwrites.
        timeout_s: in rounds, the bound of each wait for the writer.
        what: the staging mode, as messages name it.
        advice: what to do about a tensor changed before its copy.
    """

    def __init__(self, gate: StagingGate, copies: List[tuple], rank: int,
                 indices: Optional[List[int]] = None,
                 waits_for: Optional[Sequence[Sequence[int]]] = None,
                 timeout_s: float = DEFAULT_STAGING_WAIT_S,
                 what: str = "overlapped staging", advice: str = OVERLAPPED_ADVICE):
        self.gate: Optional[StagingGate] = gate
        self.copies = copies
        self.rank = rank
        self.indices = indices
        self.waits_for = waits_for
        self.timeout_s = timeout_s
        self.what = what
        self.advice = advice
        self.copied = 0
        self.done = threading.Event()
        self.stream = None
        if any(source.device.type == "cuda" for _, source, _, _ in copies):
            # The side stream starts after the work queued so far on the current stream.
            self.stream = torch.cuda.Stream()
            self.stream.wait_stream(torch.cuda.current_stream())

    def progress(self) -> int:
        """How many items are copied (the trainer's waits go on while this moves)."""
        return self.copied

    def run(self) -> None:
        """Copy every tensor, run after run, then mark the gate staged; a failure is
        recorded on the gate instead (the trainer's copy thread)."""
        gate = self.gate
        try:
            position = 0
            while position < len(self.copies):
                end = self._next_run(position)
                if end is None:
                    return  # the writer failed and reads nothing more: its error fails the save
                self._copy(position, end)
                position = self.copied = end
            gate.mark_staged()
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
        """The end of the run of items from ``position`` that may be copied now: all of
        them in one go; in rounds, once the writer freed the first one's bytes (a bounded
        wait), it and the following ones already free. None: the writer is done."""
        if self.waits_for is None:
            return len(self.copies)
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
        sources: on the side stream, checked once the stream is synchronized); in rounds,
        mark each copied once its bytes are in the buffers."""
        on_stream = []
        for k in range(start, end):
            name, source, buffer, version = self.copies[k]
            self._check(name, source, version)
            if source.device.type == "cuda":
                with torch.cuda.stream(self.stream):
                    buffer.copy_(source, non_blocking=True)
                on_stream.append(k)
            else:
                buffer.copy_(source)
                self._check(name, source, version)  # not changed while it was copied
                self._mark_copied(k)
        if on_stream:
            wait_for_stream(self.stream, holding=[self.copies[k][2] for k in on_stream])
            for k in on_stream:
                name, source, _, version = self.copies[k]
                self._check(name, source, version)
                self._mark_copied(k)

    def _mark_copied(self, k: int) -> None:
        if self.indices is not None:
            self.gate.mark_copied(self.indices[k])

    def _keep_queued_copies(self) -> None:
        """After a failure: the buffers live on until the queued device copies land."""
        if self.stream is not None:
            landed_after_failure(stream=self.stream, holding=[b for _, _, b, _ in self.copies])

    def _check(self, name: str, source: torch.Tensor, version: Optional[int]) -> None:
        """Raise if ``source`` changed since scheduling (an inference tensor, recorded
        without a version, is not checked)."""
        if version is None:
            return
        now = source._version
        if now != version:
            raise StagingRaceError(
                f"rank {self.rank}: saved tensor {name!r} was modified in place before "
                f"{self.what} had copied it (version {version} -> {now}), so this save "
                f"would mix two training steps and fails on every rank. {self.advice}"
            )
