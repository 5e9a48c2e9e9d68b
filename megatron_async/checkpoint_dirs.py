"""A Megatron-LM save directory: ``iter_*`` checkpoints and the tracker.

::

    <save>/iter_0000100/            one torch_dist checkpoint per saved iteration
    <save>/iter_0000200/
    <save>/latest_checkpointed_iteration.txt    "200"

Pure storage functions for any single process (the coordinator rank that moves the
tracker and chooses what to resume from or delete, the command-line tools that list
checkpoints).
:class:`~megatron_async.manager.CheckpointManager` builds the multi-rank policy (resume,
commit, retention) on top of them.

``<save>`` may be a local directory or an ``msc://PROFILE/PREFIX`` URL (object storage);
each function asks :func:`~megatron_async.storage.storage_for` once for the storage
that serves its path; :mod:`megatron_async.storage.objects` says how an object store
keeps the same guarantees without directories, rename or fsync.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import re
import uuid
from typing import Iterable, List, Optional, Sequence

from megatron_async.errors import CheckpointIntegrityError, CheckpointValidationError
from megatron_async.format import (
    COMPLETION_MARKERS,
    TRACKER_FILE,
    missing_completion_markers,
)
from megatron_async.storage.backend import CheckpointStorage, storage_for

__all__ = [
    "CheckpointInfo",
    "ResumePoint",
    "check_save_dir_writable",
    "checkpoint_dir_name",
    "choose_resume_point",
    "create_fresh_checkpoint_dir",
    "delete_checkpoint_dir",
    "is_complete_checkpoint",
    "iteration_from_path",
    "list_checkpoints",
    "mark_latest_checkpoint",
    "read_tracker",
    "select_for_deletion",
    "write_tracker",
]

logger = logging.getLogger(__name__)

_ITER_DIR = re.compile(r"iter_(\d+)$")


def iteration_from_path(path: str) -> Optional[int]:
    """The iteration of a Megatron-LM ``iter_NNNNNNN`` directory, else None."""
    match = _ITER_DIR.search(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def checkpoint_dir_name(iteration: int) -> str:
    """Return the directory name of ``iteration``'s checkpoint: ``iter_0000100``."""
    try:
        step = operator.index(iteration)  # ints, numpy and torch integers; not "2" or 2.0
    except TypeError:
        step = -1
    if isinstance(iteration, bool) or step < 0:
        raise CheckpointValidationError(
            f"iteration must be an int >= 0 (the training step), got {iteration!r}"
        )
    return f"iter_{step:07d}"


def is_complete_checkpoint(path: str, storage: Optional[CheckpointStorage] = None) -> bool:
    """Return True when ``path`` is a directory holding every completion marker (the
    format's rule, :func:`~megatron_async.format.missing_completion_markers`)."""
    return not missing_completion_markers(path, storage or storage_for(path))


def check_save_dir_writable(save_dir: str) -> None:
    """Create ``save_dir`` if it is missing, then write and remove a small probe file in it.

    Runs on one rank (each rank probes for itself: a mount may differ between nodes).
    The probe is named ``.write-probe-*``, outside the ``iter_*`` namespace, so a probe
    left by a crash is never taken for a checkpoint. Under an ``msc://`` prefix it is
    one PUT and one DELETE, which also finds a missing bucket or bad credentials.

    Raises:
        CheckpointValidationError: ``save_dir`` cannot be created or written; the
            message names it and the cause.
    """
    storage = storage_for(save_dir)
    probe = os.path.join(save_dir, f".write-probe-{uuid.uuid4().hex}")
    try:
        if not storage.is_dir(save_dir):
            try:
                storage.make_dir(save_dir)
            except FileExistsError:  # another rank created it first
                pass
        storage.write_atomically(probe, b"")
        storage.remove(probe)
    except OSError as exc:  # ObjectStoreError is one too
        raise CheckpointValidationError(
            f"save directory {save_dir} is not writable ({type(exc).__name__}: {exc}); "
            "choose a save_dir (the example's --save) that every rank can create and write"
        ) from exc


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One ``iter_*`` directory of a save directory.

    Attributes:
        iteration: the iteration in the directory name.
        complete: whether it holds every completion marker.
    """

    iteration: int
    path: str
    complete: bool


def list_checkpoints(save_dir: str) -> List[CheckpointInfo]:
    """List the ``iter_*`` directories of ``save_dir``, oldest first (none if it is missing)."""
    storage = storage_for(save_dir)
    found = []
    for name, num_bytes in storage.list_dir(save_dir):
        path = os.path.join(save_dir, name)
        iteration = iteration_from_path(path)
        if num_bytes is None and iteration is not None:  # a directory
            found.append(CheckpointInfo(iteration, path, is_complete_checkpoint(path, storage)))
    return sorted(found, key=lambda info: info.iteration)


def read_tracker(save_dir: str) -> Optional[int]:
    """Return the iteration the tracker of ``save_dir`` names, or None without a tracker.

    Raises:
        CheckpointValidationError: the tracker exists but does not hold an iteration
            number (Megatron-LM's ``release`` marker included).
    """
    path = os.path.join(save_dir, TRACKER_FILE)
    try:
        text = storage_for(path).read(path).decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise CheckpointValidationError(
            f"tracker {path} contains {text[:40]!r}, expected an iteration number; "
            "release checkpoints are not supported. Fix or delete the file, or pass the "
            "iteration to load explicitly."
        )
    return int(text)


def write_tracker(save_dir: str, iteration: int) -> None:
    """Point the tracker of ``save_dir`` at ``iteration``, atomically and durably.

    After a crash the tracker holds either the old or the new iteration
    (``CheckpointStorage.write_atomically``; in object storage one PUT). Runs on the
    coordinator rank only.
    """
    storage_for(save_dir).write_atomically(os.path.join(save_dir, TRACKER_FILE), f"{iteration}\n")


def mark_latest_checkpoint(save_dir: str, iteration: int) -> None:
    """Make ``iteration``'s complete checkpoint durable, then point the tracker at it
    (the coordinator rank, when every rank's save is durable).

    Raises:
        CheckpointIntegrityError: the checkpoint lacks a completion marker; the tracker
            keeps naming the previous checkpoint.
    """
    path = os.path.join(save_dir, checkpoint_dir_name(iteration))
    storage = storage_for(path)
    missing = missing_completion_markers(path, storage)
    if missing:
        raise CheckpointIntegrityError(
            f"checkpoint {path} is missing {missing} after its save finished; not "
            "marking it as the latest"
        )
    # Files need an fsync; an object store acknowledged each marker's PUT durably.
    for marker in COMPLETION_MARKERS:
        storage.sync(os.path.join(path, marker))
    storage.sync_dir(path)
    write_tracker(save_dir, iteration)
    logger.info("checkpoint %s is complete; tracker updated", path)


def create_fresh_checkpoint_dir(save_dir: str, iteration: int) -> None:
    """Create ``iteration``'s empty checkpoint directory, deleting the remains of an earlier
    save of it first, so that stale shard files never mix with new ones (the coordinator rank).

    Raises:
        CheckpointValidationError: the tracker points at it (overwriting it would leave no
            complete checkpoint while the save runs), or its remains cannot be deleted.
    """
    path = os.path.join(save_dir, checkpoint_dir_name(iteration))
    if read_tracker(save_dir) == iteration:
        raise CheckpointValidationError(
            f"refusing to overwrite {path}: the tracker of {save_dir} points at it, and "
            "overwriting would leave no complete checkpoint while the save runs. Save "
            "under a new iteration or into another directory."
        )
    storage = storage_for(path)
    if storage.is_dir(path):
        logger.warning("deleting the remains of an earlier save of %s", path)
        if not delete_checkpoint_dir(path):
            raise CheckpointValidationError(
                f"cannot delete the earlier checkpoint directory {path}; remove it by hand"
            )
    storage.make_dir(path)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from.

    Attributes:
        reason: why it was chosen: ``"requested"`` (an explicit iteration),
            ``"tracker"``, or ``"newest complete"`` (the tracker was missing or pointed
            at an incomplete directory).
    """

    iteration: int
    path: str
    reason: str


def choose_resume_point(load_dir: str, iteration: Optional[int]) -> Optional[ResumePoint]:
    """Choose the checkpoint of ``load_dir`` to resume from (the coordinator rank).

    The rule of :meth:`~megatron_async.manager.CheckpointManager.find_resume_point`,
    which shares this choice with every rank; None when there is no complete checkpoint.

    Raises:
        CheckpointValidationError: ``iteration`` has no complete checkpoint, or the
            tracker holds no iteration number.
    """
    if iteration is not None:
        path = os.path.join(load_dir, checkpoint_dir_name(iteration))
        if not is_complete_checkpoint(path):
            raise CheckpointValidationError(
                f"cannot resume from iteration {iteration}: {path} is not a complete "
                f"checkpoint (it needs {' and '.join(COMPLETION_MARKERS)}); choose one of "
                f"{[c.iteration for c in list_checkpoints(load_dir) if c.complete]}"
            )
        return ResumePoint(iteration, path, "requested")
    tracked = read_tracker(load_dir)
    complete = [c for c in list_checkpoints(load_dir) if c.complete]
    if tracked is not None:
        path = os.path.join(load_dir, checkpoint_dir_name(tracked))
        if is_complete_checkpoint(path):
            return ResumePoint(tracked, path, "tracker")
        complete = [c for c in complete if c.iteration < tracked]
        logger.warning(
            "tracker of %s points at iteration %d, but %s is not a complete checkpoint",
            load_dir, tracked, path,
        )
    if not complete:
        return None
    newest = complete[-1]
    logger.warning("resuming from the newest complete checkpoint of %s: %s", load_dir, newest.path)
    return ResumePoint(newest.iteration, newest.path, "newest complete")


def select_for_deletion(
    checkpoints: Sequence[CheckpointInfo],
    keep_last_n: int,
    protected: Iterable[int],
) -> List[CheckpointInfo]:
    """Choose the checkpoints that retention deletes; pure, for the coordinator rank.

    Rules:
      * the newest ``keep_last_n`` complete checkpoints are kept;
      * a checkpoint whose iteration is in ``protected`` (the one the tracker points to,
        the ones being written) is never chosen;
      * an incomplete directory older than the newest kept or protected checkpoint is
        the remains of a failed or killed save and is chosen; a newer incomplete one may
        still be written and is left alone.

    Args:
        checkpoints: the directories, in any order.
        keep_last_n: how many complete checkpoints to keep (at least 1:
            :class:`~megatron_async.manager.CheckpointManagerConfig` checks it).
        protected: iterations that must survive.

    Returns:
        The checkpoints to delete, oldest first.
    """
    protected = set(protected)
    complete = sorted((c for c in checkpoints if c.complete), key=lambda c: -c.iteration)
    kept = {c.iteration for c in complete[:keep_last_n]} | protected
    newest_kept = max(kept, default=-1)
    victims = [
        c
        for c in checkpoints
        if c.iteration not in kept and (c.complete or c.iteration < newest_kept)
    ]
    return sorted(victims, key=lambda c: c.iteration)


def delete_checkpoint_dir(path: str) -> bool:
    """Take ``path`` out of the complete checkpoints, then delete it; False on failure.

    Its completion markers go first (``CheckpointStorage.remove_dir``).
    """
    try:
        storage_for(path).remove_dir(path, first=COMPLETION_MARKERS)
    except OSError as exc:  # ObjectStoreError is one too
        logger.warning("could not delete checkpoint %s: %s", path, exc)
        return False
    return True
