"""The one owner of what a process's saves may touch: the directories being written, and
whether a file-system step was left behind (every rank, its own record).

Two rules replace per-path bookkeeping:

* **A directory being written is never written again.** A save claims its directory when
  it starts and releases it when its commit step ends (or when its request is dropped
  unfinalized); a second save into a claimed directory is refused, alike on every rank
  (every rank schedules the same saves, and the strategy's target check is agreed).
* **A step left behind stops the process's saves.** A file-system step between two
  collectives runs on a helper thread, bounded (:meth:`SaveDirectories.run_bounded`).
  One that never returns (a hung mount) may still complete much later, over newer files,
  so from then on this record is *stuck*: every later save of the process fails at once,
  saying to restart the job. One state, no race with a step that returns late.

The record is reachable as :meth:`SaveDirectories.of_process` because megatron-core's
``common.pt`` step (0.16-0.18), which runs before any sharded strategy, is a process-wide
hook; everything else receives it explicitly (the strategy, its finalizer, the manager).
Paths are compared as normalized names (``normalize_checkpoint_path``), with no
file-system call: a claim is checked and released on failure paths, where the file
system may be the thing that hangs.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, TypeVar

from megatron_async.core import coordination
from megatron_async.core.helper_threads import DeadlineExpired, HelperThreads
from megatron_async.core.one_per_process import OnePerProcess
from megatron_async.errors import AsyncTimeoutError, CheckpointInProgressError

__all__ = [
    "Claim",
    "FileSystemStepTimeoutError",
    "SaveDirectories",
    "coordinator_step_timeout_s",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

HUNG_MOUNT_HINT = "the file system is not answering (a hung network mount?); check the mount"
FINALIZE_OR_MOVE_ON = (
    "finalize it first (AsyncCallsQueue.maybe_finalize_async_calls(blocking=True)) or save "
    "into another directory (one per iteration, as Megatron-LM does)"
)


class FileSystemStepTimeoutError(AsyncTimeoutError):
    """A bounded file-system step of a save (rank 0's, or every rank's) did not return in time."""


def coordinator_step_timeout_s() -> float:
    """How long a bounded file-system step may take: half the coordination group's timeout,
    so the rank reports the failure while the others still wait for it in a collective."""
    return coordination.coordination_timeout_s() / 2


class Claim:
    """One save's hold on its directory; :meth:`release` ends it (idempotent)."""

    def __init__(self, owner: "SaveDirectories", directory: str) -> None:
        self.directory = directory
        self._owner = owner

    def release(self) -> None:
        """Free the directory for the next save (any thread; no file-system call)."""
        self._owner._release(self)

    def release_when_dropped(self, holder: Any) -> None:
        """Release when ``holder`` is garbage collected (a request never finalized)."""
        weakref.finalize(holder, self._owner._release, self)


class SaveDirectories(OnePerProcess):
    """The directories a process's saves are writing, and whether a step was left behind.

    Thread-safe; every method runs on the rank that calls it, with no collective and no
    file-system call (but :meth:`run_bounded`, which runs the caller's step).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: Dict[str, Claim] = {}  # directory -> the claim of the save writing it
        self._stuck: Optional[str] = None

    def __reduce__(self):
        """A pickled strategy (or a copy sent to another process) gets that process's record."""
        return (SaveDirectories.of_process, ())

    def __deepcopy__(self, memo: Dict[int, Any]) -> "SaveDirectories":
        return self  # a copied strategy writes the same process's directories

    @property
    def stuck(self) -> Optional[str]:
        """The step left behind (what it did), or None."""
        return self._stuck

    def refuse_if_stuck(self) -> None:
        """Raise if a step was left behind: no save of this process may start or commit.

        Raises:
            CheckpointInProgressError: naming the step, and saying to restart the job.
        """
        stuck = self._stuck
        if stuck is not None:
            raise CheckpointInProgressError(
                f"rank {coordination.get_rank()}: {stuck} did not return in time and may "
                "still complete over newer files, so this process saves no more "
                f"checkpoints; {HUNG_MOUNT_HINT}, then restart the job (it resumes from "
                "the latest complete checkpoint)"
            )

    def refuse_if_claimed(self, directory: str) -> None:
        """Raise if an unfinalized save of this process writes ``directory`` (normalized).

        Raises:
            CheckpointInProgressError: it does; nothing was written.
        """
        with self._lock:
            if directory in self._claims:
                raise _still_being_written(directory)

    def claim(self, directory: str, advice: str = FINALIZE_OR_MOVE_ON) -> Claim:
        """Mark ``directory`` (normalized; async ``torch.save``'s file) as being written by
        a new save; a refusal says ``advice``.

        Raises:
            CheckpointInProgressError: a step was left behind, or the directory is claimed.
        """
        self.refuse_if_stuck()
        with self._lock:
            if directory in self._claims:
                raise _still_being_written(directory, advice)
            claim = self._claims[directory] = Claim(self, directory)
        return claim

    def directories(self) -> List[str]:
        """The directories being written, sorted."""
        with self._lock:
            return sorted(self._claims)

    def _release(self, claim: Claim) -> None:
        with self._lock:
            if self._claims.get(claim.directory) is claim:
                del self._claims[claim.directory]

    def run_bounded(
        self,
        what: str,
        step: Callable[[], T],
        timeout_s: Optional[float] = None,
        hint: str = f"{HUNG_MOUNT_HINT}, then restart the job",
    ) -> T:
        """Run one file-system step of a save within its bound (the rank that runs it).

        A step that does not return in time is left behind on its daemon thread, and this
        record becomes stuck (see the module docstring).

        Args:
            what: the step, for messages (``"writing .metadata of /ckpt/iter_10"``).
            step: the step; it must be safe to complete after its caller gave up.
            timeout_s: the bound; :func:`coordinator_step_timeout_s` by default.
            hint: what the message says is likely wrong and what to do.

        Raises:
            FileSystemStepTimeoutError: ``step`` did not return in time.
            Exception: whatever ``step`` raised.
        """
        bound_s = coordinator_step_timeout_s() if timeout_s is None else timeout_s
        try:
            return HelperThreads.of_process().run(step, bound_s, f"save step: {what}")
        except DeadlineExpired as exc:
            with self._lock:
                self._stuck = self._stuck or what
            logger.error("%s did not return within %gs; left behind: no more saves", what, bound_s)
            raise FileSystemStepTimeoutError(
                f"{what} did not return within {bound_s:g}s: {hint}"
            ) from exc


def _still_being_written(directory: str, advice: str = FINALIZE_OR_MOVE_ON) -> CheckpointInProgressError:
    return CheckpointInProgressError(
        f"an earlier save of this process into {directory} is not finalized yet; {advice}"
    )

