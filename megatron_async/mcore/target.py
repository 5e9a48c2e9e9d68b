"""Check that one save may write into its target directory (every rank, local).

:class:`~megatron_async.mcore.strategy.TorchDistAsyncSaveStrategy` runs
:func:`check_save_target` on every rank in the local step of its first collective, so a
refusal on any rank becomes the same error on every rank (see
:meth:`~megatron_async.mcore.plan_cache.PlanCache.plan_save`). Nothing here runs a
collective or talks to another rank.

What it checks, in this order:

* no unfinalized save of this process still writes the directory
  (:data:`~megatron_async.mcore.in_flight.checkpoints_in_flight`);
* a local directory exists, is a directory and is writable by this rank; an
  object-storage URL needs ``use_msc`` (a store has no directories or permissions to
  probe: an unreachable endpoint or a missing bucket fails the first request, which the
  background writer reports on every rank);
* on the coordinator only, a complete checkpoint already there: ``overwrite=False``
  refuses it; otherwise its completion markers are set aside first (with a warning;
  :mod:`megatron_async.mcore.set_aside`), so a save that then fails leaves a directory
  that every loader sees as incomplete, never a mix of old and new data, and a save
  refused while planning gets them back. megatron-core writes ``common.pt`` before the
  strategy runs, which is why overwriting is the default (see
  :mod:`megatron_async.mcore.strategy`).

Raises :class:`~megatron_async.errors.CheckpointInProgressError` for a directory still
being written and :class:`~megatron_async.errors.CheckpointValidationError` for anything
else; each message names the rank or the path and what to do.

:func:`claim_save_target`, what the strategy calls, runs those checks and the directory's
claim within a bound (half the coordination timeout, on a helper thread): on a hung
mount even ``os.path.exists`` never returns, and the rank would never reach the save's
first collective. A check left behind that returns later gives back what it took (the
claim, the markers it set aside), and keeps the directory taken until then.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Tuple

from megatron_async.core import coordination
from megatron_async.core.coordinator_step import (
    FileSystemStepTimeoutError,
    leave_behind,
    refuse_while_left_behind,
    run_coordinator_step,
)
from megatron_async.errors import CheckpointInProgressError, CheckpointValidationError
from megatron_async.format import (
    COMPLETION_MARKERS, DCP_METADATA_FILE, has_completion_markers, remove_completion_markers,
)
from megatron_async.mcore.common_guard import take_skipped_common_write
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.mcore.in_flight import checkpoints_in_flight
from megatron_async.mcore.set_aside import SetAside, set_aside
from megatron_async.storage.backend import CheckpointStorage, storage_for
from megatron_async.storage.client import MSC_EXTRA_HINT

__all__ = ["check_save_target", "claim_save_target"]

logger = logging.getLogger(__name__)


def check_save_target(
    checkpoint_dir: str, config: TorchDistSaveConfig, is_coordinator: bool
) -> Optional[SetAside]:
    """Raise if this rank cannot save into ``checkpoint_dir`` (every rank, local).

    On the coordinator, an existing complete checkpoint is refused with
    ``config.overwrite`` False, or made incomplete first (its completion markers set
    aside in a local directory, removed in an object store).

    Returns:
        The markers set aside (coordinator, local directory), for the caller to restore
        if planning fails or to discard once the save is finalized; else None.

    Args:
        checkpoint_dir: the normalized target (a local path or an object-storage URL).
        config: the strategy's options (``overwrite``, ``use_msc``).
        is_coordinator: whether this rank handles an existing checkpoint.

    Raises:
        CheckpointInProgressError: an unfinalized save of this process writes it.
        CheckpointValidationError: the target is missing, not a directory, not writable,
            an object-storage URL without ``use_msc``, or a complete checkpoint with
            ``overwrite=False``.
    """
    rank = coordination.get_rank()
    if checkpoint_dir in checkpoints_in_flight:
        raise CheckpointInProgressError(
            f"an earlier save of this process into {checkpoint_dir} is not finalized yet; "
            "finalize it first (AsyncCallsQueue.maybe_finalize_async_calls(blocking=True)) "
            "or save into another directory"
        )
    refuse_while_left_behind(checkpoint_dir)  # an earlier commit step still stuck on it
    storage = storage_for(checkpoint_dir)
    if storage.needs_msc:
        _check_object_target(checkpoint_dir, config, is_coordinator, storage)
        return None
    if not os.path.exists(checkpoint_dir):
        raise CheckpointValidationError(
            f"rank {rank}: checkpoint directory {checkpoint_dir} does not exist; create it "
            "(visible to every rank) before saving"
        )
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointValidationError(
            f"rank {rank}: checkpoint path {checkpoint_dir} is not a directory"
        )
    if not os.access(checkpoint_dir, os.W_OK | os.X_OK):
        raise CheckpointValidationError(
            f"rank {rank}: checkpoint directory {checkpoint_dir} is not writable"
        )
    marker = os.path.join(checkpoint_dir, DCP_METADATA_FILE)
    if is_coordinator and os.path.exists(marker):
        _refuse_unless_overwrite(
            checkpoint_dir, config,
            f"{checkpoint_dir} already holds a complete torch_dist checkpoint ({marker} "
            "exists) and overwrite=False; save into a new directory or delete it first",
        )
        return set_aside(checkpoint_dir, COMPLETION_MARKERS)
    return None


def _check_object_target(
    checkpoint_dir: str, config: TorchDistSaveConfig, is_coordinator: bool, storage: CheckpointStorage
) -> None:
    """The checks of :func:`check_save_target` that mean something in an object store."""
    if not config.use_msc:
        raise CheckpointValidationError(
            f"{checkpoint_dir} is an object-storage URL; create the strategy with "
            f"use_msc=True ({MSC_EXTRA_HINT})"
        )
    if is_coordinator and has_completion_markers(checkpoint_dir, storage):
        _refuse_unless_overwrite(
            checkpoint_dir, config,
            f"{checkpoint_dir} already holds a complete torch_dist checkpoint and "
            "overwrite=False; save under a new prefix or delete it first",
        )
        remove_completion_markers(checkpoint_dir, storage)  # a store has no rename


def _refuse_unless_overwrite(checkpoint_dir: str, config: TorchDistSaveConfig, refusal: str) -> None:
    """Refuse a complete checkpoint with ``refusal`` unless ``config.overwrite``; else warn
    that it is about to be unmarked (coordinator)."""
    if not config.overwrite:
        raise CheckpointValidationError(refusal)
    logger.warning(
        "overwriting the torch_dist checkpoint in %s; its completion markers are removed "
        "first, so it reads as incomplete until this save is finalized",
        checkpoint_dir,
    )


def claim_save_target(
    checkpoint_dir: str, config: TorchDistSaveConfig, is_coordinator: bool
) -> Tuple[int, Optional[SetAside]]:
    """:func:`check_save_target`, then claim the directory, within a bound (every rank).

    Returns:
        The claim's token in ``checkpoints_in_flight`` and what was set aside.

    Raises:
        FileSystemStepTimeoutError: the file system did not answer within half the
            coordination timeout (the late check claims nothing and puts back what it set
            aside; until it returns the directory stays taken).
        CheckpointInProgressError, CheckpointValidationError: as :func:`check_save_target`.
    """
    refuse_while_left_behind(checkpoint_dir)  # no file-system call: before the bounded step
    if is_coordinator and take_skipped_common_write(checkpoint_dir):
        raise CheckpointInProgressError(
            f"megatron-core's common.pt was not written for this save of {checkpoint_dir}: a "
            "step of an earlier save was still running on the directory then; save again"
        )
    hand_over = _HandOver(checkpoint_dir)

    def check_and_claim() -> Tuple[int, Optional[SetAside]]:
        return hand_over.give(check_save_target(checkpoint_dir, config, is_coordinator))

    try:
        return run_coordinator_step(
            f"checking the save target {checkpoint_dir}", check_and_claim,
            path=checkpoint_dir, error=FileSystemStepTimeoutError,
        )
    except BaseException:  # timed out or interrupted: a late check gives back what it took
        hand_over.abandon()
        raise


class _HandOver:
    """Passes a bounded check's set-aside, and the claim it makes for the waiting save, to
    that save; once the save gave up, a late check claims nothing and puts back what it
    set aside. A result handed over just as the wait ended is put back on a thread that
    keeps the directory taken (:func:`leave_behind`) until it is done."""

    def __init__(self, checkpoint_dir: str) -> None:
        self._dir = checkpoint_dir
        self._lock = threading.Lock()
        self._abandoned = False
        self._given: Optional[Tuple[int, Optional[SetAside]]] = None

    def give(self, aside: Optional[SetAside]) -> Tuple[int, Optional[SetAside]]:
        """The check's side: claim and hand over, or put ``aside`` back if nobody waits."""
        with self._lock:
            if not self._abandoned:
                self._given = (checkpoints_in_flight.claim(self._dir), aside)
                return self._given
        _restore(aside)  # on the late check's own thread, still taken while it runs
        return -1, None

    def abandon(self) -> None:
        """The save's side, after the bound or an interrupt: give back a late result."""
        with self._lock:
            self._abandoned = True
            given, self._given = self._given, None
        if given is not None:
            thread = threading.Thread(target=self._give_back, args=given, daemon=True)
            thread.start()
            leave_behind(self._dir, thread, f"giving back the save target {self._dir}")

    def _give_back(self, token: int, aside: Optional[SetAside]) -> None:
        try:
            _restore(aside)
        finally:  # free only once the markers are back
            checkpoints_in_flight.release(self._dir, token)


def _restore(aside: Optional[SetAside]) -> None:
    if aside is not None and aside.moved:
        aside.restore()
