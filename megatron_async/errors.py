"""The exception hierarchy of megatron_async.

Every error the library raises on purpose derives from :class:`AsyncCheckpointError`.
A failure of a background save is always reported on *every* rank as one
:class:`AsyncSaveFailedError` that carries each failing rank's :class:`RankFailure`
(exception type, message, traceback text and the phase it happened in), so that a
training job can catch a single type and log what went wrong everywhere.

:class:`AsyncSaveFailedError` derives from PyTorch DCP's ``CheckpointException``, so it
is created on first use (module ``__getattr__``): the command-line tools import this
module without paying for importing torch.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Dict, Mapping, Optional


__all__ = [
    "AsyncCheckpointError",
    "CheckpointValidationError",
    "CheckpointInProgressError",
    "QueueClosedError",
    "FrozenRequestError",
    "WorkerDiedError",
    "AsyncTimeoutError",
    "CoordinationError",
    "CheckpointIntegrityError",
    "StorageWriteError",
    "StagingMemoryError",
    "StagingRaceError",
    "UnsupportedMegatronError",
    "ModuleSurfaceConflictError",
    "ObjectStoreUnavailableError",
    "ObjectStoreError",
    "RankFailure",
    "AsyncSaveFailedError",
]


class AsyncCheckpointError(Exception):
    """Base class of every error raised by megatron_async."""


class CheckpointValidationError(AsyncCheckpointError, ValueError):
    """Bad input: wrong types, overlapping or missing shards, an unusable target directory."""


class CheckpointInProgressError(AsyncCheckpointError):
    """A save targets a directory that an unfinished save of this process still writes."""


class QueueClosedError(AsyncCheckpointError, RuntimeError):
    """A request was scheduled on an :class:`AsyncCallsQueue` after ``close()``."""


class FrozenRequestError(AsyncCheckpointError, RuntimeError):
    """A finalize function was added to an :class:`AsyncRequest` that is already scheduled."""


class WorkerDiedError(AsyncCheckpointError):
    """A background process ended (signal, segfault, early exit) before reporting a result."""


class AsyncTimeoutError(AsyncCheckpointError, TimeoutError):
    """A bounded wait in the async path expired (a frozen writer, a stuck staging step)."""


class CoordinationError(AsyncCheckpointError):
    """A checkpoint-coordination collective failed: a peer rank died, diverged or timed out."""


class CheckpointIntegrityError(AsyncCheckpointError):
    """Checkpoint content does not match what was written (missing item, bad checksum)."""


class UnsupportedMegatronError(AsyncCheckpointError, ImportError):
    """The installed megatron-core lacks the interfaces this package plugs into."""


class ModuleSurfaceConflictError(AsyncCheckpointError, RuntimeError):
    """Our nvidia-resiliency-ext module surface cannot be served: the real package is installed."""


class StagingMemoryError(AsyncCheckpointError, MemoryError):
    """Host memory for staging a checkpoint (shared memory) could not be allocated."""


class ObjectStoreUnavailableError(AsyncCheckpointError, ImportError):
    """Object storage (``use_msc``, ``msc://`` paths) was asked for without the ``msc`` extra."""


class ObjectStoreError(AsyncCheckpointError, OSError):
    """An object store refused or failed a request (endpoint down, credentials, bucket)."""


class StagingRaceError(AsyncCheckpointError):
    """A saved tensor changed before overlapped staging had copied it; the save fails."""


class StorageWriteError(AsyncCheckpointError):
    """A background writer failed to write checkpoint files; ``failure`` keeps its traceback."""

    def __init__(self, message: str, failure: Optional["RankFailure"] = None):
        super().__init__(message)
        self.failure = failure

    def __reduce__(self):
        return (type(self), (str(self), self.failure))


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank, in a form that pickles across processes and ranks.

    Attributes:
        rank: global rank on which the failure happened.
        phase: where in the save it happened: ``"schedule"``, ``"staging"``, ``"write"``,
            ``"worker"`` (the background process died), ``"timeout"`` or ``"finalize"``.
        exception_type: qualified name of the original exception class.
        message: ``str()`` of the original exception.
        traceback_text: the formatted traceback, as captured where the exception happened.
    """

    rank: int
    phase: str
    exception_type: str
    message: str
    traceback_text: str = ""

    @classmethod
    def from_exception(cls, rank: int, phase: str, exc: BaseException) -> "RankFailure":
        """Capture ``exc`` (with its traceback) as a picklable record."""
        exc_type = type(exc)
        return cls(
            rank=rank,
            phase=phase,
            exception_type=f"{exc_type.__module__}.{exc_type.__qualname__}",
            message=str(exc),
            traceback_text="".join(traceback.format_exception(exc_type, exc, exc.__traceback__)),
        )

    def summary(self) -> str:
        """One line: rank, phase, exception type and message.

        A failure of the background part reads "Worker failure: ...", megatron-core's
        wording (``FileSystemWriterAsync.retrieve_write_results``), which log alerts and
        Megatron-LM's tests search for.
        """
        text = f"{self.exception_type}: {self.message}"
        if self.phase in _WORKER_PHASES and "worker failure" not in text.lower():
            text = f"Worker failure: {text}"
        return f"rank {self.rank} [{self.phase}] {text}"


_WORKER_PHASES = frozenset({"write", "worker", "timeout"})
"""Phases of a :class:`RankFailure` in the background part of a save: a write that
raised, a worker that died, a bounded wait that expired."""


def _define_async_save_failed_error() -> type:
    """Create :class:`AsyncSaveFailedError` (imports torch's DCP exception type)."""
    from torch.distributed.checkpoint.api import CheckpointException

    class AsyncSaveFailedError(AsyncCheckpointError, CheckpointException):
        """A checkpoint save failed on at least one rank; raised identically on every rank.

        It is also a :class:`torch.distributed.checkpoint.api.CheckpointException`, so code
        written against megatron-core or PyTorch DCP that catches that type keeps working.

        Attributes:
            failures: failing rank -> :class:`RankFailure`.
            checkpoint: the checkpoint (usually a directory) the save was writing, if known.
        """

        def __init__(
            self,
            failures: Mapping[int, RankFailure],
            checkpoint: Optional[str] = None,
            hint: str = "",
        ):
            self.checkpoint = checkpoint
            self._hint = hint
            ordered: Dict[int, RankFailure] = dict(sorted(failures.items()))
            where = f" of {checkpoint}" if checkpoint else ""
            lines = [f"async checkpoint save{where} failed on {len(ordered)} rank(s):"]
            lines += [f"  {failure.summary()}" for failure in ordered.values()]
            lines.append(
                hint
                or "The checkpoint is incomplete and was not marked complete; the previous "
                "complete checkpoint is untouched. Fix the cause above and save again."
            )
            CheckpointException.__init__(self, "\n".join(lines), ordered)

        @property
        def failures(self) -> Dict[int, RankFailure]:  # type: ignore[override]
            """Failing rank -> :class:`RankFailure`."""
            return self._failures

        def __str__(self) -> str:
            return self.args[0]

        def __reduce__(self):
            return (type(self), (self._failures, self.checkpoint, self._hint))

        def full_report(self) -> str:
            """The message followed by every failing rank's traceback."""
            parts = [str(self)]
            for failure in self.failures.values():
                if failure.traceback_text:
                    parts.append(f"--- rank {failure.rank} traceback ---\n{failure.traceback_text}")
            return "\n".join(parts)

    # Defined in a function only to defer importing torch; pickled by this name.
    AsyncSaveFailedError.__qualname__ = "AsyncSaveFailedError"
    return AsyncSaveFailedError


def __getattr__(name: str):
    if name == "AsyncSaveFailedError":
        cls = _define_async_save_failed_error()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
