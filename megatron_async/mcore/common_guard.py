"""Protect checkpoints still being written or already complete from megatron-core's
``common.pt`` write (0.16-0.18).

megatron-core up to 0.18.x writes ``common.pt`` (rank 0, synchronously) in
``dist_checkpointing.save`` *before* it calls the sharded save strategy, so a sharded
strategy alone comes too late:

* a second save into a directory that an async save is still writing would replace the
  first save's ``common.pt`` before the strategy can refuse it;
* overwriting a complete checkpoint would put a new ``common.pt`` next to the old
  completion markers, so a crash right then leaves a mixed checkpoint that looks complete.

:func:`check_common_target` runs first, on every rank, against the process's
:class:`~megatron_async.core.save_directories.SaveDirectories`: a directory still being
written is refused on every rank alike (every rank schedules the same saves); rank 0
removes the markers of a complete checkpoint (bounded), then megatron-core writes
``common.pt`` (bounded too). A process whose saves stopped (a step left behind), or a
step here that does not return in time, leaves ``common.pt`` untouched and lets the save
go on to the sharded strategy, whose agreed target check then refuses it on every rank
(another strategy would save without ``common.pt``, which megatron-core's loader
rejects: never a mixed checkpoint).

The checks are put in front of megatron-core's common save in whichever form the
installed generation has (:func:`megatron_async.mcore.generation.register_strategies`
chooses): on 0.16.x :class:`GuardedCommonSaveStrategy`, megatron-core's ``torch``
common-save strategy with the checks, registered as the default that ``save()`` looks up;
on 0.17 / 0.18 :func:`guard_save_common_function` wraps the plain ``save_common``
function that ``serialization.save()`` calls; 0.19+ stores the common state inside the
checkpoint: nothing to guard.

Because the guard cannot know which sharded strategy follows, the markers of a complete
checkpoint go before ``common.pt`` whatever it is: the strategy's ``overwrite=False``
protects a complete checkpoint only where the strategy is the first to touch the
directory (megatron-core 0.19+, or a direct ``async_save``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable, Union

from megatron.core.dist_checkpointing.mapping import StateDict

from megatron_async.core import coordination
from megatron_async.core.save_directories import FileSystemStepTimeoutError, SaveDirectories
from megatron_async.errors import CheckpointValidationError
from megatron_async.format import remove_completion_markers
from megatron_async.storage.backend import normalize_checkpoint_path, storage_for

__all__ = ["check_common_target", "guarded_common_strategy_class", "guard_save_common_function"]

logger = logging.getLogger(__name__)


def check_common_target(checkpoint_dir: Union[str, Path], directories: SaveDirectories) -> bool:
    """Refuse a directory being written; unmark a complete one (every rank, before common.pt).

    Returns:
        Whether megatron-core may write ``common.pt`` now (rank 0; True elsewhere).

    Raises:
        CheckpointInProgressError: an unfinalized async save of this process still
            writes ``checkpoint_dir``; nothing was written.
        CheckpointValidationError: rank 0 may not remove the completion markers of the
            complete checkpoint there; nothing was changed.
    """
    directory = normalize_checkpoint_path(checkpoint_dir)
    directories.refuse_if_claimed(directory)
    if coordination.get_rank() != 0:
        return True
    if directories.stuck:
        logger.warning("leaving common.pt of %s untouched: %s", directory, directories.stuck)
        return False
    storage = storage_for(directory)
    try:
        removed = directories.run_bounded(
            f"unmarking {directory}", lambda: remove_completion_markers(directory, storage),
            error=FileSystemStepTimeoutError,
        )
    except FileSystemStepTimeoutError as exc:  # stuck now: the strategy refuses everywhere
        logger.error("leaving common.pt of %s untouched: %s", directory, exc)
        return False
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


def _guarded_write(
    write: Callable[[], Any], checkpoint_dir: Union[str, Path], directories: SaveDirectories
) -> Any:
    """Run megatron-core's ``common.pt`` write behind the checks, bounded (every rank)."""
    if not check_common_target(checkpoint_dir, directories):
        return None
    if coordination.get_rank() != 0:  # megatron-core writes on rank 0 only
        return write()
    try:
        return directories.run_bounded(
            f"writing common.pt of {checkpoint_dir}", write, error=FileSystemStepTimeoutError
        )
    except FileSystemStepTimeoutError as exc:  # stuck now: the strategy refuses everywhere
        logger.error("%s", exc)
        return None


def guarded_common_strategy_class(directories: SaveDirectories) -> type:
    """Registry generation: megatron-core's ``torch`` common-save strategy with the checks
    against ``directories`` (the process's record)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy

    class GuardedCommonSaveStrategy(TorchCommonSaveStrategy):
        """megatron-core's ``torch`` common-save strategy that refuses unsafe targets first."""

        def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]) -> None:
            """Check the target, then write ``common.pt`` as megatron-core does (rank 0)."""
            write = functools.partial(super().save_common, common_state_dict, checkpoint_dir)
            _guarded_write(write, checkpoint_dir, directories)

    return GuardedCommonSaveStrategy


def guard_save_common_function(
    module: Any, directories: SaveDirectories, name: str = "save_common"
) -> bool:
    """0.17 / 0.18: wrap ``module.<name>`` (the function ``save()`` calls) with the checks
    against ``directories`` (the process's record).

    Idempotent; returns whether the function is guarded now.
    """
    original: Callable[..., None] = getattr(module, name)
    if getattr(original, "__megatron_async_guarded__", False):
        return True

    @functools.wraps(original)
    def guarded_save_common(common_state_dict: StateDict, checkpoint_dir: Union[str, Path], *args, **kwargs):
        write = functools.partial(original, common_state_dict, checkpoint_dir, *args, **kwargs)
        return _guarded_write(write, checkpoint_dir, directories)

    guarded_save_common.__megatron_async_guarded__ = True
    setattr(module, name, guarded_save_common)
    return True
