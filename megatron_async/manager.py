"""Resume, commit, retention and the save failure policy of a Megatron-LM save
directory, on every rank.

The directory layout (``iter_*`` checkpoints, the tracker) and its file operations are
in :mod:`megatron_async.checkpoint_dirs`; this module decides, for a multi-rank job,
what to resume from, when the tracker moves, what retention may delete, and whether a
failed save ends the job.

With an async save the tracker moves in a finalize function of the save's request
(:meth:`CheckpointManager.attach_commit`); a synchronous save calls
:meth:`CheckpointManager.commit` right after ``dist_checkpointing.save`` returns.

Every method of :class:`CheckpointManager` runs on every rank unless its docstring says
otherwise; decisions that must agree across ranks (which checkpoint to resume from) are
taken on rank 0 and shared over the checkpoint-coordination group. A failed save (an
:class:`~megatron_async.errors.AsyncSaveFailedError` from finalization, or a
:class:`~megatron_async.errors.CheckpointValidationError` /
:class:`~megatron_async.errors.CheckpointInProgressError` from planning) is raised
identically on every rank, so every rank takes the same decision about it without a
collective.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional, Set

from megatron_async.checkpoint_dirs import (
    ResumePoint,
    check_save_dir_writable,
    checkpoint_dir_name,
    choose_resume_point,
    create_fresh_checkpoint_dir,
    delete_checkpoint_dir,
    list_checkpoints,
    mark_latest_checkpoint,
    read_tracker,
    select_for_deletion,
)
from megatron_async.core import coordination
from megatron_async.core.coordination import agreed_step
from megatron_async.core.request import AsyncRequest
from megatron_async.core.save_directories import SaveDirectories
from megatron_async.errors import (
    AsyncSaveFailedError,
    CheckpointInProgressError,
    CheckpointValidationError,
    RankFailure,
)

__all__ = [
    "CheckpointManager",
    "CheckpointManagerConfig",
    "ResumePoint",
    "SaveFailurePolicy",
    "TooManySaveFailuresError",
]

logger = logging.getLogger(__name__)

_SAVE_FAILURES = (AsyncSaveFailedError, CheckpointValidationError, CheckpointInProgressError)


class TooManySaveFailuresError(AsyncSaveFailedError):
    """``max_consecutive_failures`` saves failed in a row under the ``continue`` policy.

    Carries the last failure's per-rank records (``rank_failures``), like any
    :class:`~megatron_async.errors.AsyncSaveFailedError`.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveFailurePolicy:
    """How a job reacts to a failed checkpoint save (:meth:`CheckpointManager.save_failed`)."""

    mode: str = "raise"
    """``"raise"`` (the failure ends the job) or ``"continue"`` (log it, save again at the
    next interval)."""

    max_consecutive_failures: int = 3
    """Under ``"continue"``: this many failed saves in a row end the job with
    :class:`TooManySaveFailuresError`; one successful save resets the count."""

    def __post_init__(self) -> None:
        if self.mode not in ("raise", "continue"):
            raise CheckpointValidationError(
                f"save failure policy must be one of ('raise', 'continue'), got {self.mode!r}"
            )
        if not isinstance(self.max_consecutive_failures, int) or self.max_consecutive_failures < 1:
            raise CheckpointValidationError(
                "max_consecutive_failures must be an integer >= 1 (1 stops at the first "
                f"failure, like mode='raise'); got {self.max_consecutive_failures!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointManagerConfig:
    """Where checkpoints go and how many stay."""

    save_dir: Optional[str] = None
    """Directory that receives ``iter_*`` checkpoints and the tracker; None disables saving."""

    load_dir: Optional[str] = None
    """Directory to resume from (often the same as ``save_dir``); None starts from scratch."""

    keep_last_n: Optional[int] = None
    """Keep only the newest N complete checkpoints in ``save_dir``; None keeps all. The
    checkpoint the tracker points to and checkpoints still being written are never deleted."""

    save_failure: SaveFailurePolicy = dataclasses.field(default_factory=SaveFailurePolicy)
    """What :meth:`CheckpointManager.save_failed` does: end the job (default) or go on."""

    def __post_init__(self) -> None:
        if self.keep_last_n is not None and self.keep_last_n < 1:
            raise CheckpointValidationError(
                f"keep_last_n must be at least 1 (the latest checkpoint is always kept) or "
                f"None to keep every checkpoint; got {self.keep_last_n}"
            )
        if self.keep_last_n is not None and self.save_dir is None:
            raise CheckpointValidationError("keep_last_n needs a save_dir to apply to")


class CheckpointManager:
    """Name, commit, find and prune Megatron-LM style iteration checkpoints.

    Create one per training process, on every rank, with the same config. The manager
    keeps the set of iterations this process is still saving, so that retention never
    deletes a checkpoint in flight, and counts the failed saves since the last durable
    one (``consecutive_save_failures``) for the save failure policy.

    Construction is a collective when there is a ``save_dir``: every rank creates it if
    it is missing and writes a probe file into it (within the file-system step bound),
    so a bad save location fails before training starts, with the same
    :class:`CheckpointValidationError` ("... is not writable ...") on every rank.

    Args:
        directories: the record whose steps left behind stop the process's saves, in which
            the probe, tracker and retention steps run (default: the process's, which the
            strategy uses too).
    """

    def __init__(self, config: CheckpointManagerConfig, directories: Optional[SaveDirectories] = None):
        self.config = config
        self._directories = directories or SaveDirectories.of_process()
        self._in_flight: Set[int] = set()
        self.consecutive_save_failures = 0
        if config.save_dir is not None:
            what = f"checking the save directory {config.save_dir}"
            probe = functools.partial(check_save_dir_writable, config.save_dir)
            # Bounded: on a hung mount the check fails on every rank instead of hanging one.
            agreed_step(what, lambda: self._directories.run_bounded(
                what, probe,
                hint="the file system is not answering; check the mount or pick another save_dir"))

    @property
    def in_flight(self) -> Set[int]:
        """Iterations whose save was prepared but not committed yet (a copy)."""
        return set(self._in_flight)

    def checkpoint_path(self, iteration: int) -> str:
        """Return ``<save_dir>/iter_XXXXXXX`` for ``iteration``."""
        return os.path.join(self._require_save_dir(), checkpoint_dir_name(iteration))

    def prepare_save(self, iteration: int) -> str:
        """Create the empty directory for ``iteration``'s checkpoint and mark it in flight.

        Runs on every rank (a collective: rank 0 creates the directory, then all ranks
        wait for it). The remains of an earlier, unfinished save of the same iteration
        are deleted first, so that stale shard files never mix with new ones.

        Returns:
            The checkpoint directory.

        Raises:
            CheckpointValidationError: ``iteration`` is no int >= 0, is the checkpoint
                the tracker points to (overwriting it would leave no complete checkpoint
                during the save), or a save of it is already in flight.
            AsyncSaveFailedError: on every rank, when rank 0 could not prepare the
                directory, or a step was left behind on a hung mount (its
                ``CheckpointInProgressError``: restart the job).
        """
        if iteration in self._in_flight:
            raise CheckpointValidationError(
                f"a save of iteration {iteration} to {self.checkpoint_path(iteration)} is "
                "already in flight; wait for it to finalize before saving it again"
            )
        save_dir = self._require_save_dir()
        path = self.checkpoint_path(iteration)

        def prepare() -> None:
            # A late .metadata or tracker write could land over this save: refuse before
            # any data is written.
            self._directories.refuse_if_stuck()
            create_fresh_checkpoint_dir(save_dir, iteration)

        coordination.run_on_coordinator("prepare", prepare, path)
        self._in_flight.add(iteration)
        return path

    def attach_commit(self, request: AsyncRequest, iteration: int) -> None:
        """Make ``request`` commit ``iteration`` once its save is durable on every rank.

        Runs on every rank, before the request is scheduled. Adds :meth:`commit` as a
        finalize function: finalize functions run in order after every rank's background
        write finished, and megatron-core's ``dist_checkpointing.save`` already added the
        one that writes ``metadata.json``, so the tracker is written after it.
        """
        if not callable(getattr(request, "add_finalize_fn", None)):
            raise CheckpointValidationError(
                f"attach_commit needs the AsyncRequest of the save, got {type(request).__name__}: "
                "pass what dist_checkpointing.save(..., async_sharded_save=True) returned"
            )
        checkpoint_dir_name(iteration)  # a valid iteration, before anything is attached
        request.add_finalize_fn(functools.partial(self.commit, iteration))

    def abandon(self, iteration: int) -> None:
        """Forget a save of ``iteration`` that failed (every rank, no collective).

        Its commit never runs, so without this the iteration would stay in flight: it
        could not be saved again, and retention would keep its incomplete directory.
        Call it when the job goes on after an ``AsyncSaveFailedError`` for that save.
        """
        self._in_flight.discard(iteration)

    def save_failed(self, iteration: int, error: BaseException) -> None:
        """Apply the save failure policy to a failed save of ``iteration`` (every rank).

        Forgets the save (:meth:`abandon`: its directory stays without completion
        markers, so no resume picks it, and the next save of that iteration clears it),
        then returns under the ``continue`` policy or raises.

        Raises:
            ``error``: under the ``raise`` policy, or when it is no save failure.
            TooManySaveFailuresError: too many failed saves in a row.
        """
        self.abandon(iteration)
        policy = self.config.save_failure
        if policy.mode == "raise" or not isinstance(error, _SAVE_FAILURES):
            raise error  # a lost peer (CoordinationError) or a bug always ends the job
        self.consecutive_save_failures += 1
        if self.consecutive_save_failures >= policy.max_consecutive_failures:
            raise self._too_many_failures(error) from error
        logger.error(
            "checkpoint save of iteration %d (%s) failed (%d in a row, %d allowed); training "
            "goes on and the next interval saves again. The tracker still names the last "
            "complete checkpoint. Cause:\n%s",
            iteration, self.checkpoint_path(iteration), self.consecutive_save_failures,
            policy.max_consecutive_failures, error,
        )

    def commit(self, iteration: int) -> None:
        """Mark ``iteration``'s checkpoint as the latest, then apply retention.

        Runs on every rank (a collective); rank 0 checks that the checkpoint is complete,
        fsyncs its markers, writes the tracker atomically and deletes checkpoints that
        retention no longer keeps. A failure on rank 0 is raised on every rank.

        Raises:
            AsyncSaveFailedError: on every rank, when the checkpoint was incomplete or
                the tracker could not be written; the tracker then still points at the
                previous checkpoint.
        """
        path = self.checkpoint_path(iteration)
        mark = functools.partial(mark_latest_checkpoint, self.config.save_dir, iteration)

        def commit_step() -> None:
            self._directories.refuse_if_stuck()
            self._directories.run_bounded(f"marking {path} as the latest checkpoint", mark)

        try:
            coordination.run_on_coordinator("commit", commit_step, path)
        finally:
            self._in_flight.discard(iteration)
        self.consecutive_save_failures = 0
        if coordination.get_rank() == 0 and self.config.keep_last_n is not None:
            try:
                self._directories.run_bounded(f"applying retention after {path}", self._apply_retention)
            except Exception as exc:  # best-effort cleanup: the checkpoint itself is committed
                logger.warning("retention after committing %s failed: %s", path, exc)

    def find_resume_point(self, iteration: Optional[int] = None) -> Optional[ResumePoint]:
        """Choose the checkpoint of ``load_dir`` to resume from; the same on every rank.

        Runs on every rank (a collective): rank 0 looks at the file system and shares its
        choice. Without an explicit ``iteration`` the tracker decides; when it is missing
        or points at an incomplete directory, the newest complete checkpoint (not newer
        than the tracker) is chosen and a warning logged. An incomplete directory is
        never chosen.

        Args:
            iteration: resume from exactly this iteration (Megatron-LM's ``--ckpt-step``).

        Returns:
            The resume point, or None when there is no ``load_dir`` or no complete
            checkpoint in it (a fresh start).

        Raises:
            CheckpointValidationError: on every rank, when the requested iteration has
                no complete checkpoint, or the tracker or ``load_dir`` is unreadable
                (rank 0's cause in the message).
        """
        load_dir = self.config.load_dir
        if load_dir is None:
            return None

        def choose() -> Optional[ResumePoint]:
            return choose_resume_point(load_dir, iteration) if coordination.get_rank() == 0 else None

        choice, _ = agreed_step(f"looking for a checkpoint to resume from in {load_dir}", choose)
        return coordination.all_gather_objects(choice)[0]

    # Helpers below run on the coordinator rank only.

    def _apply_retention(self) -> None:
        """Delete the checkpoints that retention no longer keeps, after a commit. Best
        effort: a directory that cannot be deleted is logged and left for the next commit."""
        save_dir, keep_last_n = self.config.save_dir, self.config.keep_last_n
        tracked = read_tracker(save_dir)
        protected = self._in_flight if tracked is None else self._in_flight | {tracked}
        doomed = select_for_deletion(list_checkpoints(save_dir), keep_last_n, protected)
        deleted = [info.path for info in doomed if delete_checkpoint_dir(info.path)]
        if deleted:
            logger.info("retention (keep last %d) deleted %s", keep_last_n, ", ".join(deleted))

    def _too_many_failures(self, error: BaseException) -> TooManySaveFailuresError:
        if isinstance(error, AsyncSaveFailedError):
            failures, checkpoint = error.rank_failures, error.checkpoint
        else:  # a planning failure: raised alike on every rank, recorded as this rank's
            rank = coordination.get_rank()
            failures, checkpoint = {rank: RankFailure.from_exception(rank, "plan", error)}, None
        return TooManySaveFailuresError(
            failures, checkpoint,
            hint=f"{self.consecutive_save_failures} checkpoint saves failed in a row, the most "
            "the save failure policy allows; the job stops. Fix the cause above and resume "
            "from the last complete checkpoint.",
        )

    def _require_save_dir(self) -> str:
        if self.config.save_dir is None:
            raise CheckpointValidationError(
                "this CheckpointManager has no save_dir; set CheckpointManagerConfig.save_dir"
            )
        return self.config.save_dir
