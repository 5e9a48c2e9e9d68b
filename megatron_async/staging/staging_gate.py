"""The gate between a save's overlapped copy and its background writer (both sides).

:class:`StagingGate` is a few bytes of shared memory: the trainer's copy thread marks it
staged or failed (with the message), and the background writer, a forked process or the
persistent worker, waits on it before it writes a byte (:func:`write_after_staging`).
See :mod:`.overlapped` for the staging itself.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from megatron_async.core import shared_memory
from megatron_async.errors import AsyncTimeoutError, StagingRaceError

__all__ = ["DEFAULT_STAGING_WAIT_S", "StagingGate", "write_after_staging"]

DEFAULT_STAGING_WAIT_S = 600.0
"""Bound on every wait for an overlapped copy (trainer and background writer)."""

_PENDING, _STAGED, _FAILED = 0, 1, 2
_GATE_BYTES = 4096
_MESSAGE_OFFSET = 16


class StagingGate:
    """Whether one save's overlapped copy is done: a few bytes of shared memory.

    Created by the trainer with the request; the background writer (a forked process or
    the persistent worker, which receives the segment by reference) waits on it. Holds
    the state and, after a failure, the error message.
    """

    def __init__(self, segment: Optional[torch.Tensor] = None):
        self.segment = segment if segment is not None else shared_memory.allocate_segment(_GATE_BYTES)

    def _words(self) -> torch.Tensor:
        return self.segment[:_MESSAGE_OFFSET].view(torch.int64)

    @property
    def state(self) -> int:
        return int(self._words()[0])

    def mark_staged(self) -> None:
        """Trainer (copy thread): every tensor is in the host buffers."""
        self._words()[0] = _STAGED

    def mark_failed(self, message: str) -> None:
        """Trainer (copy thread): the copy failed; the writer raises ``message``."""
        data = message.encode("utf-8", "replace")[: _GATE_BYTES - _MESSAGE_OFFSET]
        if data:
            self.segment[_MESSAGE_OFFSET : _MESSAGE_OFFSET + len(data)].copy_(
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
            )
        words = self._words()
        words[1] = len(data)
        words[0] = _FAILED

    def message(self) -> str:
        length = int(self._words()[1])
        raw = bytes(self.segment[_MESSAGE_OFFSET : _MESSAGE_OFFSET + length].tolist())
        return raw.decode("utf-8", "replace")

    def wait(self, timeout_s: float = DEFAULT_STAGING_WAIT_S) -> None:
        """Background writer: return once the copy is done (bounded).

        Raises:
            StagingRaceError: the copy failed (a saved tensor changed before it was copied).
            AsyncTimeoutError: the copy did not finish within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        pause = 0.0005
        while self.state == _PENDING:
            if time.monotonic() > deadline:
                raise AsyncTimeoutError(
                    f"the overlapped staging copy did not finish within {timeout_s:.0f}s; the "
                    "trainer process is stuck or gone. Save without overlap_staging to rule it out"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        if self.state == _FAILED:
            raise StagingRaceError(self.message())

    def __reduce__(self):
        return (StagingGate, (self.segment,))


def write_after_staging(
    gate: StagingGate, timeout_s: float, write_fn: Callable[..., None], *args: Any
) -> None:
    """Background writer: wait for the trainer's overlapped copy, then write.

    A failed copy raises here, before anything is written: the call fails, and with it
    the save on every rank at finalization.
    """
    gate.wait(timeout_s)
    write_fn(*args)
