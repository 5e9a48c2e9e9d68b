"""CPU and I/O priority of the background writer (runs in the background process).

While a background write runs, the writer competes with the training loop for CPU time
(hashing, framing, copying into the page cache) and for the disk. A writer that runs at
a lower priority than the trainer takes what the trainer leaves idle, so the training
step keeps its speed and the write takes longer only when the trainer needs the CPU.

On Linux the nice value and the I/O priority belong to a thread, and new threads and
processes inherit them from the one that creates them. :func:`lower_writer_priority` is
called by the background process's main thread before it starts any writer thread, so
every writer of a save inherits the priority; the trainer is never touched. Lowering priority needs no privileges. Elsewhere (no ``ioprio_set``), the I/O
part is skipped with a debug message.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import platform
from typing import Optional

from megatron_async.errors import CheckpointValidationError

__all__ = ["WriterPriority", "lower_writer_priority"]

logger = logging.getLogger(__name__)

_IO_CLASSES = {"realtime": 1, "best-effort": 2, "idle": 3}
"""Linux I/O scheduling classes (``IOPRIO_CLASS_*``); ``"inherit"`` leaves it alone."""

_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_WHO_PROCESS = 1  # with id 0: the calling thread
_IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "ppc64le": (273, 274), "s390x": (282, 283)}
"""Machine -> (``ioprio_set``, ``ioprio_get``) system call numbers (glibc has no wrapper)."""


def _ioprio_syscall(which: int) -> Optional[int]:
    numbers = _IOPRIO_SYSCALLS.get(platform.machine())
    return numbers[which] if numbers is not None and platform.system() == "Linux" else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriterPriority:
    """How much the background writer yields to the training loop.

    The default, nice +10 and best-effort I/O level 7, lets the writer use what the
    trainer leaves idle without starving it when the machine is busy (a nice +10 thread
    gets about a tenth of the CPU time of a nice 0 thread competing for the same core).
    ``io_class="idle"`` writes only when no other process uses the disk: the most
    polite, but a save can then wait for long on a disk that training reads from.
    """

    nice_increment: int = 10
    """Added to the trainer's nice value (0: the trainer's priority; at most 19)."""

    io_class: str = "best-effort"
    """``"best-effort"``, ``"idle"`` or ``"inherit"`` (keep the trainer's I/O priority)."""

    io_level: int = 7
    """Level within ``best-effort``: 0 (highest) to 7 (lowest)."""

    def __post_init__(self) -> None:
        if isinstance(self.nice_increment, bool) or not isinstance(self.nice_increment, int) or not (
            0 <= self.nice_increment <= 19
        ):
            raise CheckpointValidationError(
                f"WriterPriority.nice_increment must be an int from 0 to 19 (0 keeps the "
                f"trainer's CPU priority), got {self.nice_increment!r}"
            )
        if self.io_class not in ("best-effort", "idle", "inherit"):
            raise CheckpointValidationError(
                "WriterPriority.io_class must be 'best-effort', 'idle' or 'inherit', got "
                f"{self.io_class!r} (a real-time class would need privileges and starve training)"
            )
        if isinstance(self.io_level, bool) or not isinstance(self.io_level, int) or not (
            0 <= self.io_level <= 7
        ):
            raise CheckpointValidationError(f"WriterPriority.io_level must be an int from 0 to 7, got {self.io_level!r}")


def lower_writer_priority(priority: WriterPriority) -> None:
    """Lower the calling thread's CPU and I/O priority (background process, main thread).

    Call it before starting writer threads or processes: they inherit it. Best effort: a
    failure is logged at DEBUG level and the write goes on at the inherited priority.
    """
    if priority.nice_increment:
        try:
            os.nice(priority.nice_increment)
        except OSError as exc:
            logger.debug("cannot lower the writer's CPU priority: %s", exc)
    if priority.io_class == "inherit":
        return
    level = priority.io_level if priority.io_class == "best-effort" else 0
    value = (_IO_CLASSES[priority.io_class] << _IOPRIO_CLASS_SHIFT) | level
    number = _ioprio_syscall(0)
    if number is None:
        logger.debug("I/O priority is not supported here; the writer keeps the trainer's")
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(number, _IOPRIO_WHO_PROCESS, 0, value) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as exc:
        logger.debug("cannot set the writer's I/O priority: %s", exc)
