"""The control block of a save staged in rounds: what the stager and the writer share.

One small shared-memory segment per save (see :mod:`megatron_async.staging.rounds`): a
header (the trainer's failure state and message, the writer's *done* mark, whether the
save is staged in rounds) and one state word per tensor item (pending, copied, written).
The trainer creates it in ``preload_fn``, before the fork or the send, so a forked writer
inherits it and the persistent worker maps it from its segment reference. The writer
records its process id when it starts reading, so the trainer's waits end when it is gone.

Both sides run code from here: the trainer marks items copied and records a failure; the
background writer marks items written and the whole save done; either waits on the
other's marks with :func:`wait_on_control` (bounded, and ending at the other side's failure).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch

from megatron_async.core import shared_memory
from megatron_async.errors import AsyncTimeoutError, StagingRaceError, WorkerDiedError

__all__ = ["RoundsControl", "wait_on_control"]

_PENDING, _COPIED, _WRITTEN = 0, 1, 2
_OK, _FAILED = 0, 1
_HEADER_WORDS = 5  # failure state, message length, writer done, staged in rounds, writer pid
_LIVENESS_PERIOD_S = 0.5
_MESSAGE_BYTES = 4096


class RoundsControl:
    """One save's shared state between the stager and the background writer.

    A shared-memory segment: a header (failure state and message, the writer's *done*
    mark) and one word per tensor item (pending, copied, written). Created by the trainer
    in ``preload_fn``; pickles as its segment, so the persistent worker maps it.
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
        return (RoundsControl, (0, self.segment))

    # -- items ---------------------------------------------------------------------
    def item_state(self, idx: int) -> int:
        return int(self._words[_HEADER_WORDS + idx])

    def mark_copied(self, idx: int) -> None:
        self._words[_HEADER_WORDS + idx] = _COPIED

    def mark_written(self, idx: int) -> None:
        self._words[_HEADER_WORDS + idx] = _WRITTEN

    def is_written(self, idx: int) -> bool:
        return self.item_state(idx) == _WRITTEN

    def is_staged(self, idx: int) -> bool:
        """Whether the item's bytes are in the pool (copied, or already written)."""
        return self.item_state(idx) != _PENDING

    # -- the whole save ------------------------------------------------------------
    def fail(self, message: str) -> None:
        """Trainer: staging failed; the writer raises ``message`` instead of waiting."""
        data = message.encode("utf-8", "replace")[:_MESSAGE_BYTES]
        if data:
            self.segment[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._words[1] = len(data)
        self._words[0] = _FAILED

    @property
    def failed(self) -> bool:
        return int(self._words[0]) == _FAILED

    def message(self) -> str:
        return bytes(self.segment[: int(self._words[1])].tolist()).decode("utf-8", "replace")

    def mark_done(self) -> None:
        """Writer: nothing of the staged data will be read any more."""
        for idx in range(self.num_items):
            self.mark_written(idx)
        self._words[2] = 1

    @property
    def writer_done(self) -> bool:
        return int(self._words[2]) == 1

    def start_rounds(self) -> None:
        """Trainer: this save is staged in rounds; the writer waits for each item."""
        self._words[3] = 1

    @property
    def in_rounds(self) -> bool:
        return int(self._words[3]) == 1

    def record_writer(self) -> None:
        """Writer: this process reads the staged data (the trainer watches it)."""
        self._words[4] = os.getpid()

    def writer_gone(self) -> bool:
        """Trainer: whether the recorded writer process ended (False before it recorded)."""
        pid = int(self._words[4])
        return pid > 0 and not _process_running(pid)


def _process_running(pid: int) -> bool:
    """Whether ``pid`` runs; a dead child that its parent has not reaped yet does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no procfs: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True


def wait_on_control(
    condition: Callable[[], bool], control: RoundsControl, deadline: float, what: str,
    watch_writer: bool = False,
) -> None:
    """Poll ``condition`` until true; raise on the trainer's failure mark or the deadline,
    and with ``watch_writer`` (the trainer's waits) once the writer's process is gone."""
    pause = 0.0002
    next_check = time.monotonic() + _LIVENESS_PERIOD_S
    while not condition():
        if control.failed:
            raise StagingRaceError(control.message())
        now = time.monotonic()
        if now > deadline:
            raise AsyncTimeoutError(what)
        if watch_writer and now > next_check:
            next_check = now + _LIVENESS_PERIOD_S
            if control.writer_gone():
                raise WorkerDiedError(
                    "the background writer of this save ended before it freed the staging "
                    "memory (staging in rounds); the save fails, see the writer's error"
                )
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
