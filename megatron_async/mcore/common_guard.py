"""Protect ``common.pt`` of checkpoints that are still being written or already complete.

megatron-core up to 0.18.x writes ``common.pt`` (rank 0, synchronously) in
``dist_checkpointing.save`` *before* it calls the sharded save strategy. A sharded
strategy alone therefore comes too late to protect a checkpoint directory:

* a second save into a directory that an async save is still writing would replace the
  first save's ``common.pt`` before the strategy can refuse it;
* overwriting a complete checkpoint would put a new ``common.pt`` next to the old
  completion markers, so a crash right then leaves a mixed checkpoint that looks complete.

:func:`check_common_target` makes those two checks; it is put in front of megatron-core's
common save in whichever form the installed generation has
(:func:`megatron_async.mcore.generation.register_strategies` chooses):

* registry generation (0.16.x): :class:`GuardedCommonSaveStrategy`, megatron-core's
  ``torch`` common-save strategy with the checks, registered as the default that
  ``save()`` looks up;
* 0.17 / 0.18: :func:`guard_save_common_function` wraps the plain ``save_common``
  function that ``serialization.save()`` calls;
* 0.19+ stores the common state inside the checkpoint: nothing to guard.

Every ``dist_checkpointing.save`` of the process gets the protection, whatever its sharded
strategy. It runs on every rank; each rank decides from its own record of in-flight saves,
which is the same on all ranks because every rank schedules the same saves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Set, Union

from megatron.core.dist_checkpointing.mapping import StateDict

from megatron_async.core import coordination
from megatron_async.core.coordinator_step import refuse_while_left_behind, steps_left_behind
from megatron_async.errors import CheckpointInProgressError, CheckpointValidationError
from megatron_async.format import (
    COMMON_FILE, COMPLETION_MARKERS, has_completion_markers, remove_completion_markers,
)
from megatron_async.mcore.in_flight import checkpoints_in_flight
from megatron_async.mcore.set_aside import drop_registered, set_aside
from megatron_async.storage.backend import normalize_checkpoint_path, storage_for

__all__ = ["check_common_target", "guarded_common_strategy_class", "guard_save_common_function"]

logger = logging.getLogger(__name__)

_SAVE_MODULE = "megatron.core.dist_checkpointing.serialization"
_FRAMES_TO_SAVE = 6  # this check <- the guard's wrapper <- (a strategy method) <- save()


def check_common_target(checkpoint_dir: Union[str, Path]) -> bool:
    """Refuse a directory being written; unmark a complete one (every rank, before common.pt).

    A complete checkpoint is refused instead when the calling ``save()`` uses our strategy
    with ``overwrite=False``. With our strategy's ``overwrite=True``, its markers and its
    ``common.pt`` are set aside, not deleted, so that a save refused while planning puts
    them back (:mod:`megatron_async.mcore.set_aside`); a set-aside that no strategy took
    (its save failed in between, before any data file changed) is put back first.

    A commit step left behind on a hung mount (:mod:`megatron_async.core.coordinator_step`)
    is known to rank 0 alone: with our strategy, rank 0 then leaves ``common.pt`` untouched
    and the strategy's agreed target check refuses the save on every rank; with another
    strategy rank 0 raises alone (the others fail by that strategy's own timeouts).

    Returns:
        Whether megatron-core may write ``common.pt`` now.

    Raises:
        CheckpointInProgressError: an unfinalized async save of this process still
            writes ``checkpoint_dir``; nothing was written.
        CheckpointValidationError: ``checkpoint_dir`` holds a complete checkpoint and the
            strategy has ``overwrite=False``, or rank 0 may not remove its completion
            markers; nothing was changed.
    """
    directory = normalize_checkpoint_path(checkpoint_dir)
    if directory in checkpoints_in_flight:
        raise CheckpointInProgressError(
            f"an earlier async save of this process into {directory} is not finalized yet; "
            "its common.pt was left untouched. Finalize it first "
            "(AsyncCallsQueue.maybe_finalize_async_calls(blocking=True)) or save into "
            "another directory"
        )
    import torch.distributed as dist

    storage = storage_for(directory)
    is_coordinator = dist.get_rank() == 0
    overwrite = _calling_save_overwrite()
    stuck = is_coordinator and steps_left_behind(directory)
    if is_coordinator and not stuck:
        drop_registered(directory, restore=True)
        take_skipped_common_write(directory)  # a stale record of a save that ended earlier
    if overwrite is False:  # the same on every rank: so is this collective
        complete = is_coordinator and not stuck and has_completion_markers(directory, storage)
        if coordination.all_reduce_max([int(complete)])[0]:
            raise CheckpointValidationError(
                f"{directory} already holds a complete torch_dist checkpoint and the strategy "
                "has overwrite=False; its common.pt was left untouched. Save into a new "
                "directory or delete it first"
            )
    if stuck and overwrite is not None:  # our strategy refuses the save, even if the step returns
        logger.warning("leaving common.pt of %s untouched: %s is still running", directory, stuck[0])
        with _skipped_lock:
            _skipped_common_writes.add(directory)
        return False
    if stuck:
        refuse_while_left_behind(directory)
    if not is_coordinator:
        return True
    try:
        if overwrite and not storage.needs_msc:  # our strategy restores or discards them
            removed = [original for original, _ in set_aside(
                directory, (*COMPLETION_MARKERS, COMMON_FILE), register=True,
                only_if=COMPLETION_MARKERS,
            ).moved]
        else:
            removed = remove_completion_markers(directory, storage)
    except PermissionError as exc:
        raise CheckpointValidationError(
            f"rank 0: cannot change the checkpoint in {directory} ({exc}); it holds a complete "
            "checkpoint this user may not overwrite: save into a directory you can write"
        ) from exc
    if removed:
        logger.warning(
            "overwriting the checkpoint in %s: its completion markers were removed first, "
            "so it reads as incomplete until the new save is finalized",
            directory,
        )
    return True


_skipped_lock = threading.Lock()
_skipped_common_writes: Set[str] = set()
"""Directories whose ``common.pt`` rank 0 left unwritten for the save under way."""


def take_skipped_common_write(directory: str) -> bool:
    """Whether rank 0 left ``common.pt`` of ``directory`` unwritten for this save (our
    strategy's target check then refuses it on every rank); the record ends here."""
    with _skipped_lock:
        skipped = directory in _skipped_common_writes
        _skipped_common_writes.discard(directory)
        return skipped


def _calling_save_overwrite() -> Optional[bool]:
    """The ``overwrite`` option of our strategy in the megatron-core ``save()`` this check
    runs under, or None (another strategy, or no such call: the guard then unmarks).

    megatron-core hands ``common.pt``'s step neither the strategy nor its options, and it
    has resolved its ``sharded_strategy`` argument into an instance by then; so it is read
    from that call's frame (generation glue, like the finalize steps' closures)."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES_TO_SAVE):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_name == "save" and frame.f_globals.get("__name__") == _SAVE_MODULE:
            strategy = frame.f_locals.get("sharded_strategy")
            while strategy is not None and not hasattr(strategy, "config"):
                strategy = getattr(strategy, "base_strategy", None)  # a fully parallel wrapper
            overwrite = getattr(getattr(strategy, "config", None), "overwrite", None)
            return overwrite if isinstance(overwrite, bool) else None
    return None


def guarded_common_strategy_class() -> type:
    """Registry generation: megatron-core's ``torch`` common-save strategy with the checks."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy

    class GuardedCommonSaveStrategy(TorchCommonSaveStrategy):
        """megatron-core's ``torch`` common-save strategy that refuses unsafe targets first."""

        def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]) -> None:
            """Check the target, then write ``common.pt`` as megatron-core does (rank 0)."""
            if check_common_target(checkpoint_dir):
                with _restored_on_failure(checkpoint_dir):
                    super().save_common(common_state_dict, checkpoint_dir)

    return GuardedCommonSaveStrategy


def guard_save_common_function(module: Any, name: str = "save_common") -> bool:
    """0.17 / 0.18: wrap ``module.<name>`` (the function ``save()`` calls) with the checks.

    Idempotent; returns whether the function is guarded now.
    """
    original: Callable[..., None] = getattr(module, name)
    if getattr(original, "__megatron_async_guarded__", False):
        return True

    @functools.wraps(original)
    def guarded_save_common(common_state_dict: StateDict, checkpoint_dir: Union[str, Path], *args, **kwargs):
        if not check_common_target(checkpoint_dir):
            return None
        with _restored_on_failure(checkpoint_dir):
            return original(common_state_dict, checkpoint_dir, *args, **kwargs)

    guarded_save_common.__megatron_async_guarded__ = True
    setattr(module, name, guarded_save_common)
    return True


@contextlib.contextmanager
def _restored_on_failure(checkpoint_dir: Union[str, Path]):
    """If megatron-core's ``common.pt`` write raises, put back what the check set aside
    (coordinator: the old checkpoint's markers and ``common.pt``; no data file changed)."""
    try:
        yield
    except BaseException:
        drop_registered(normalize_checkpoint_path(checkpoint_dir), restore=True)
        raise
