"""The exception hierarchy of megatron_async.

Every error the library raises on purpose derives from :class:`AsyncCheckpointError`.
A failure of a background save is always reported on *every* rank as one
:class:`AsyncSaveFailedError` that carries every failing rank's :class:`RankFailure`, so
that a training job can catch a single type and log what went wrong everywhere.
"""

from __future__ import annotations

import dataclasses
import pickle
import traceback
from typing import Dict, List, Mapping, Optional, Tuple

from torch.distributed.checkpoint.api import CheckpointException


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
    "LocalCheckpointError",
    "CheckpointingException",
    "SameMachineReplicationException",
    "NoReplicasAvailableError",
    "LocalReplicationError",
    "StorageWriteError",
    "StagingMemoryError",
    "StagingRaceError",
    "StagingHandOverError",
    "UnsupportedMegatronError",
    "ModuleSurfaceConflictError",
    "ObjectStoreUnavailableError",
    "ObjectStoreError",
    "RemoteFailureError",
    "ReplacedReferenceAPIError",
    "UnpicklableRequestError",
    "RankFailure",
    "AsyncSaveFailedError",
    "LocalSaveFailedError",
    "describe_for_agreement",
    "agreed_error",
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
    """An :class:`AsyncRequest` already scheduled was scheduled again or given another
    finalize function; each save's request runs once, as it was scheduled."""


class WorkerDiedError(AsyncCheckpointError):
    """A background process ended (signal, segfault, early exit) before reporting a result."""


class AsyncTimeoutError(AsyncCheckpointError, TimeoutError):
    """A bounded wait in the async path expired (a frozen writer, a stuck staging step)."""


class CoordinationError(AsyncCheckpointError):
    """A checkpoint-coordination collective failed: a peer rank died, diverged or timed out."""


class CheckpointIntegrityError(AsyncCheckpointError):
    """Checkpoint content does not match what was written (missing item, bad checksum)."""


class LocalCheckpointError(AsyncCheckpointError):
    """A node-local checkpoint (``megatron_async.local``) cannot be saved, found or
    recovered: a replication layout that does not fit the job, a part that cannot be
    written or a state dict used out of order. The message names the rank, directory or
    iteration and says what to change."""


CheckpointingException = LocalCheckpointError
"""nvidia-resiliency-ext's name for the base error of its local checkpoint package."""


class SameMachineReplicationException(LocalCheckpointError):
    """nvidia-resiliency-ext's error for a second copy of one part written into one holder
    directory. Kept for code that imports or catches it; never raised here: each rank has
    its own holder directory and the exchange refuses a second copy of a part."""


class NoReplicasAvailableError(LocalCheckpointError):
    """No intact copy of some rank's local checkpoint part exists on any holder; the
    recovery falls back to an older local iteration or the persistent checkpoint."""


class LocalReplicationError(LocalCheckpointError):
    """A background writer could not exchange local checkpoint parts with its clique peers
    (a peer that died, stalled, never published its address or refused a damaged part).
    ``failures`` maps each peer's global rank to what happened with it."""

    def __init__(self, message: str, failures: Optional[Mapping[int, List[str]]] = None):
        super().__init__(message)
        self.failures: Dict[int, List[str]] = dict(failures or {})

    def __reduce__(self):
        return (type(self), (str(self), self.failures))


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


class StagingHandOverError(AsyncCheckpointError, RuntimeError):
    """Staging that continues after the hand-over (overlapped, or in rounds above the
    staging budget) was run by another library's caller, which cannot finish it."""


class ReplacedReferenceAPIError(AsyncCheckpointError, NotImplementedError):
    """A reference-API entry point whose mechanism this package replaces by a safer one;
    the message says what to use instead."""


class UnpicklableRequestError(AsyncCheckpointError, pickle.PicklingError):
    """A request cannot be sent to the persistent worker: something it refers to does not
    pickle (a lock a routine of the training script captures, an unstaged CUDA tensor for
    a forked worker). The message names its type and says what to do."""


class RemoteFailureError(AsyncCheckpointError):
    """Stands in for an exception of a background process or another rank that could not
    be pickled: its message names the original type and repeats the original message."""


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
        stack: the traceback's frames (DCP's form, a ``traceback.StackSummary``).
        exception_pickle: the original exception, pickled where it happened (None when it
            cannot be pickled); :meth:`exception` restores it.
    """

    rank: int
    phase: str
    exception_type: str
    message: str
    traceback_text: str = ""
    stack: Optional[traceback.StackSummary] = None
    exception_pickle: Optional[bytes] = dataclasses.field(default=None, repr=False)

    @classmethod
    def from_exception(cls, rank: int, phase: str, exc: BaseException) -> "RankFailure":
        """Capture ``exc`` (with its traceback and, if it pickles, the object) as a record."""
        exc_type = type(exc)
        return cls(
            rank=rank,
            phase=phase,
            exception_type=f"{exc_type.__module__}.{exc_type.__qualname__}",
            message=str(exc),
            traceback_text="".join(traceback.format_exception(exc_type, exc, exc.__traceback__)),
            stack=traceback.extract_tb(exc.__traceback__),
            exception_pickle=_pickle_if_possible(exc),
        )

    def exception(self) -> BaseException:
        """Return the original exception object, or a :class:`RemoteFailureError` naming it.

        The object is a copy made where the failure happened: its type, arguments and
        attributes are the original's; its traceback is in :attr:`stack` and
        :attr:`traceback_text`.
        """
        if self.exception_pickle is not None:
            try:
                return pickle.loads(self.exception_pickle)
            except Exception:  # a class that is not importable here: fall back to the text
                pass
        return RemoteFailureError(f"{self.exception_type}: {self.message}")

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


def _pickle_if_possible(exc: BaseException) -> Optional[bytes]:
    """Pickle ``exc`` if it survives a round trip (many exception classes pickle but cannot
    be unpickled, e.g. with required ``__init__`` arguments they do not pass on)."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:
        return None
    return data


_WORKER_PHASES = frozenset({"write", "worker", "timeout"})
"""Phases of a :class:`RankFailure` in the background part of a save: a write that
raised, a worker that died, a bounded wait that expired."""


def describe_for_agreement(error: BaseException, rank: int) -> Tuple[int, bool, str]:
    """``rank``'s ``error`` as a line of :func:`agreed_error`, and whether it is a save
    still in flight: ours as they read (they say what to do), anyone else's with its type,
    which is often the only information (megatron-core's ``TypeError(<class
    'torch.Tensor'>)`` for a plain tensor in a sharded state dict)."""
    message = str(error)
    if not isinstance(error, AsyncCheckpointError):
        message = f"{type(error).__name__}: {message}" if message else type(error).__name__
    message = message.removeprefix(f"rank {rank}: ")  # the agreed message names the rank
    return rank, isinstance(error, CheckpointInProgressError), message


def agreed_error(
    what: str, described: List[Tuple[int, bool, str]], cause: Optional[BaseException] = None
) -> AsyncCheckpointError:
    """The error every rank raises when the step ``what`` failed on the ranks ``described``
    (:func:`describe_for_agreement`): a :class:`CheckpointInProgressError` when each of them
    reported a save still in flight, else a :class:`CheckpointValidationError`."""
    lines = [f"{what} failed on {len(described)} rank(s):"]
    lines += [f"  rank {rank}: {message}" for rank, _, message in sorted(described)]
    busy = all(in_progress for _, in_progress, _ in described)
    error = (CheckpointInProgressError if busy else CheckpointValidationError)("\n".join(lines))
    error.__cause__ = cause
    return error


class AsyncSaveFailedError(AsyncCheckpointError, CheckpointException):
    """A checkpoint save failed on at least one rank; raised identically on every rank.

    It is also a :class:`torch.distributed.checkpoint.api.CheckpointException`, so code
    written against megatron-core or PyTorch DCP that catches that type keeps working.

    Attributes:
        failures: failing rank -> ``(exception, traceback.StackSummary)``, DCP's
            contract. The exception is the original object (a copy made where it was
            raised) when it could be pickled, else a :class:`RemoteFailureError`.
        rank_failures: failing rank -> :class:`RankFailure`, the full record (phase,
            exception type, message, formatted traceback).
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
        self.rank_failures: Dict[int, RankFailure] = dict(sorted(failures.items()))
        where = f" of {checkpoint}" if checkpoint else ""
        lines = [f"async checkpoint save{where} failed on {len(self.rank_failures)} rank(s):"]
        lines += [f"  {failure.summary()}" for failure in self.rank_failures.values()]
        lines.append(
            hint
            or "The checkpoint is incomplete and was not marked complete; complete "
            "checkpoints in other directories are untouched. Fix the cause above and save "
            "again."
        )
        wrapped = {  # DCP's form: rank -> (exception, stack)
            rank: (f.exception(), f.stack or traceback.StackSummary())
            for rank, f in self.rank_failures.items()
        }
        CheckpointException.__init__(self, "\n".join(lines), wrapped)

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return (type(self), (self.rank_failures, self.checkpoint, self._hint))


class LocalSaveFailedError(AsyncSaveFailedError, LocalCheckpointError):
    """A local checkpoint save failed on at least one rank; raised identically on every
    rank. Also nvidia-resiliency-ext's ``CheckpointingException``, which Megatron-LM's
    local saves are caught as, and still an :class:`AsyncSaveFailedError`."""
