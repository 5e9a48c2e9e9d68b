"""The gate between a save's stager and its background writer (both sides).

One small shared-memory segment per save, :class:`StagingGate`: a header (the failure
state and message, the writer's *done* mark, whether items are copied after the
hand-over, the writer's process id) and one state word per tensor item (pending, copied,
written). The trainer creates it with the save's functions, before the fork or the send,
so a forked writer inherits it and the persistent worker maps it from its segment
reference.

Staged in one go, the writer only marks the gate done once it read everything (the
budget's ledger watches that mark). Where items are copied after the hand-over (in
rounds, or overlapped), the stager marks each item copied and waits for room
(:func:`wait_for_room`); the writer waits for each item and marks it written
(:meth:`StagingGate.writer_view`).

Either side records a failure, which ends the other side's waits at once (a failed
bucket of the writer stops the trainer's copy and the writer's other buckets). Every wait
is bounded; the trainer's also end when the writer's process is gone (the writer records
its process id as it starts reading; the caller records it at the hand-over).

Ordering: an item's bytes are copied before its state word is stored, and its state word
is read before its bytes are; the two processes rely on stores becoming visible in program
order, which x86-64 guarantees (TSO). On weakly ordered CPUs (aarch64) nothing here adds a
barrier: staging in rounds is unverified there (in practice the reader polls at 0.2-5 ms
granularity, far beyond a store's visibility delay, but that is not a guarantee).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

import torch

from megatron_async.buckets.layout import WriteBucket
from megatron_async.core import shared_memory
from megatron_async.errors import (
    AsyncTimeoutError,
    StagingRaceError,
    StorageWriteError,
    WorkerDiedError,
)

__all__ = [
    "StagingGate",
    "wait_on_gate",
    "wait_for_room",
]

_PENDING, _COPIED, _WRITTEN = 0, 1, 2
_FAILED = 1
# failure, message length, writer done, copied later (in_rounds), writer pid, failed by writer
_HEADER_WORDS = 6
_LIVENESS_PERIOD_S = 0.5
_MESSAGE_BYTES = 4096


class StagingGate:
    """One save's shared state between the stager and the background writer.

    A shared-memory segment: a header (failure state and message, the writer's *done*
    mark) and one word per tensor item (pending, copied, written). Created by the trainer
    with the save's functions; pickles as its segment, so the persistent worker maps it.
    """

    def __init__(self, num_items: int = 0, segment: Optional[torch.Tensor] = None):
        if segment is None:
            segment = shared_memory.allocate_segment(
                _MESSAGE_BYTES + 8 * (_HEADER_WORDS + num_items)
            )
            segment.zero_()
        self.segment = segment
        self._words = segment[_MESSAGE_BYTES:].view(torch.int64)
        self.num_items = int(self._words.numel()) - _HEADER_WORDS

    def __reduce__(self):
        return (StagingGate, (0, self.segment))

    # -- items ---------------------------------------------------------------------
    def item_state(self, idx: int) -> int:
        return int(self._words[_HEADER_WORDS + idx])

    def mark_copied(self, idx: int) -> None:
        """Trainer: item ``idx`` is in the pool (ignored once the writer is done: a late
        copy must not turn its *written* mark back, which would hold later waits)."""
        if not self.writer_done:
            self._words[_HEADER_WORDS + idx] = _COPIED

    def mark_written(self, idx: int) -> None:
        self._words[_HEADER_WORDS + idx] = _WRITTEN

    def is_written(self, idx: int) -> bool:
        return self.item_state(idx) == _WRITTEN

    def is_staged(self, idx: int) -> bool:
        """Whether the item's bytes are in the pool (copied, or already written)."""
        return self.item_state(idx) != _PENDING

    # -- the whole save ------------------------------------------------------------
    def fail(self, message: str, by_writer: bool = False) -> None:
        """Record that the save failed: the other side raises ``message`` instead of waiting.

        The trainer calls it when a copy failed (a tensor changed before its copy, a stuck
        writer); the writer (``by_writer``) when a bucket failed, so the trainer stops
        copying for it and the writer's other buckets stop waiting. The first failure wins.
        """
        if self.failed:
            return
        data = message.encode("utf-8", "replace")[:_MESSAGE_BYTES]
        if data:
            self.segment[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._words[1] = len(data)
        self._words[5] = int(by_writer)
        self._words[0] = _FAILED

    @property
    def failed_by_writer(self) -> bool:
        return int(self._words[5]) == 1

    @property
    def failed(self) -> bool:
        return int(self._words[0]) == _FAILED

    def message(self) -> str:
        return bytes(self.segment[: int(self._words[1])].tolist()).decode("utf-8", "replace")

    def mark_done(self) -> None:
        """Writer: nothing of the staged data will be read any more.

        The done word goes first, so that a trainer copy in progress cannot mark an item
        copied again (:meth:`mark_copied`) and the trainer's waits end at it; then every
        item is marked written in one store."""
        self._words[2] = 1
        self._words[_HEADER_WORDS:].fill_(_WRITTEN)

    @property
    def writer_done(self) -> bool:
        return int(self._words[2]) == 1

    def start_rounds(self) -> None:
        """Trainer: items are copied after the hand-over (in rounds, or overlapped); the
        writer waits for each item."""
        self._words[3] = 1

    @property
    def in_rounds(self) -> bool:
        return int(self._words[3]) == 1

    def record_writer(self, pid: Optional[int] = None) -> None:
        """Record the process that reads the staged data (the trainer watches it).

        The caller records it at the hand-over (the forked child, the persistent worker),
        so a writer that dies before it reads is seen too; the writer records itself
        (``pid`` None: this process) as it starts reading."""
        self._words[4] = os.getpid() if pid is None else int(pid)

    def writer_view(
        self, staged: Optional[Sequence[WriteBucket]], timeout_s: float
    ) -> Optional[Sequence[WriteBucket]]:
        """Background writer: the staged buckets as the write path reads them.

        Records this process as the save's writer (its staging memory is freed if it
        dies). Where items are copied after the hand-over (in rounds, or overlapped), each
        bucket's tensor list waits for its items and frees them (:class:`_ArrivingItems`);
        otherwise the buckets as they are. The write path marks the gate done once it
        returns, whatever happened (:meth:`mark_done`), which frees this save's staging
        memory for the next save.
        """
        self.record_writer()
        if not self.in_rounds or staged is None:
            return staged
        first, buckets = 0, []
        for bucket in staged:
            bytes_data, tensor_data = bucket.data
            items = _ArrivingItems(tensor_data, self, first, timeout_s)
            buckets.append(WriteBucket(bucket.file_path, bucket.file_name, (bytes_data, items)))
            first += len(tensor_data)
        return buckets

    def writer_gone(self) -> bool:
        """Trainer: whether the recorded writer process ended (False before it recorded)."""
        pid = int(self._words[4])
        return pid > 0 and not _process_running(pid)


def _process_running(pid: int) -> bool:
    """Whether ``pid`` runs; a dead child that its parent has not reaped yet does not (the
    library needs procfs anyway: the persistent worker maps segments through it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone and reaped
        return False
    return state not in (b"Z", b"X")


class _ArrivingItems(list):
    """A bucket's ``(item, tensor)`` list whose items arrive after the hand-over
    (background writer).

    :func:`~megatron_async.writer.bucket_io.write_bucket` calls :meth:`before_item`
    before it reads item ``i`` and :meth:`after_item` once the item's bytes left the pool.
    """

    def __init__(self, pairs, gate: StagingGate, first: int, timeout_s: float):
        super().__init__(pairs)
        self.gate = gate
        self.first = first
        self.timeout_s = timeout_s

    def before_item(self, idx: int) -> None:
        """Wait (each item bounded on its own) until the trainer copied item ``idx``."""
        number = self.first + idx
        wait_on_gate(
            lambda: self.gate.is_staged(number), self.gate,
            time.monotonic() + self.timeout_s,
            f"the trainer staged nothing more for {self.timeout_s:.0f}s (staging after the "
            "hand-over: in rounds, or overlap_staging); it is stuck or gone",
        )

    def after_item(self, idx: int) -> None:
        self.gate.mark_written(self.first + idx)

    def abandon(self, exc: BaseException) -> None:
        """This bucket failed: stop the trainer's copy and the writer's other buckets."""
        self.gate.fail(f"the background writer failed: {type(exc).__name__}: {exc}", by_writer=True)


def wait_on_gate(
    condition: Callable[[], bool], gate: StagingGate, deadline: float, what: str,
    watch_writer: bool = False,
) -> None:
    """Poll ``condition`` until true; raise on a recorded failure or at the deadline
    (:class:`AsyncTimeoutError` saying ``what``), and with ``watch_writer`` (the trainer's
    waits) once the writer's process is gone."""
    pause = 0.0002
    next_check = time.monotonic() + _LIVENESS_PERIOD_S
    while not condition():
        if gate.failed:
            if gate.failed_by_writer:
                raise StorageWriteError(gate.message())
            raise StagingRaceError(gate.message())
        now = time.monotonic()
        if now > deadline:
            raise AsyncTimeoutError(what)
        if watch_writer and now > next_check:
            next_check = now + _LIVENESS_PERIOD_S
            if gate.writer_gone():
                raise WorkerDiedError(
                    "the background writer of this save ended before it freed the staging "
                    "memory (staging in rounds); the save fails, see the writer's error"
                )
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


def wait_for_room(
    gate: StagingGate, waits_for: Sequence[int], timeout_s: float, what: str
) -> bool:
    """Trainer: wait until the writer wrote every item of ``waits_for`` (their bytes may be
    overwritten), watching the writer's process.

    Each call has its own bound: a writer that keeps freeing the pool is never cut off,
    however long the whole save takes; one that frees nothing for ``timeout_s`` is stuck.

    Returns:
        False when the writer is done without needing more (it failed, and reads nothing
        else): the caller stops copying.

    Raises:
        AsyncTimeoutError: nothing freed within ``timeout_s`` (``what`` says what).
        StagingRaceError / StorageWriteError: the save failed on either side.
        WorkerDiedError: the writer's process is gone.
    """
    wait_on_gate(
        lambda: gate.writer_done or all(gate.is_written(k) for k in waits_for),
        gate, time.monotonic() + timeout_s, what, watch_writer=True,
    )
    return not gate.writer_done
