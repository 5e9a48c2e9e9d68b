"""Protect checkpoints still being written or already complete from megatron-core's
``common.pt`` write (0.16-0.18).

megatron-core up to 0.18.x writes ``common.pt`` (rank 0, synchronously) in
``dist_checkpointing.save`` *before* it calls the sharded save strategy, so a sharded
strategy alone comes too late:

* a second save into a directory that an async save is still writing would replace the
  first save's ``common.pt`` before the strategy can refuse it;
* overwriting a complete checkpoint would put a new ``common.pt`` next to the old
  completion markers, so a crash right then leaves a mixed checkpoint that looks complete.

The guard checks first, on every rank, against the process's
:class:`~megatron_async.core.save_directories.SaveDirectories`: a directory still being
written is refused on every rank alike (every rank schedules the same saves). Rank 0 then
removes the markers of a complete checkpoint and megatron-core writes ``common.pt``, both
bounded.

It learns the call's strategy from :mod:`megatron_async.mcore.save_call`. With our
strategy, rank 0 refuses a complete checkpoint under ``overwrite=False``, and a failure of
its step (that refusal, a full disk, a hung mount, an object that will not pickle) is not
raised on rank 0 alone, where the other ranks would wait for it in the strategy's first
collective until the coordination timeout: ``common.pt`` stays untouched, and the
strategy's agreed target check raises it on every rank. A process whose saves stopped (a
step left behind) leaves ``common.pt`` untouched the same way. With another strategy rank
0 raises as megatron-core itself would.

The checks are put in front of megatron-core's common save in whichever form the
installed generation has (:func:`megatron_async.mcore.generation.register_strategies`
chooses): on 0.16.x :class:`GuardedCommonSaveStrategy`, megatron-core's ``torch``
common-save strategy with the checks, registered as the default that ``save()`` looks up;
on 0.17 / 0.18 :func:`guard_save_common_function` wraps the plain ``save_common``
function that ``serialization.save()`` calls; 0.19+ stores the common state inside the
checkpoint: nothing to guard.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Union

from megatron.core.dist_checkpointing.mapping import StateDict

from megatron_async.core import coordination
from megatron_async.core.save_directories import SaveDirectories
from megatron_async.errors import CheckpointValidationError
from megatron_async.format import has_completion_markers, remove_completion_markers
from megatron_async.mcore.save_call import current_save_call
from megatron_async.storage.backend import normalize_checkpoint_path, storage_for

__all__ = ["guard_save_common_function", "guarded_common_strategy_class"]

logger = logging.getLogger(__name__)


def _unmark_then_write(
    write: Callable[[], Any], directory: str, directories: SaveDirectories, overwrite: Optional[bool]
) -> Any:
    """Rank 0: make a complete checkpoint there incomplete (or refuse it under
    ``overwrite=False``), then write ``common.pt``; each file-system step bounded."""
    storage = storage_for(directory)
    if overwrite is False and directories.run_bounded(
        f"checking {directory}", lambda: has_completion_markers(directory, storage),
    ):
        raise CheckpointValidationError(
            f"{directory} already holds a complete torch_dist checkpoint and the strategy "
            "has overwrite=False; its common.pt was left untouched. Save into a new "
            "directory or delete it first"
        )
    try:
        removed = directories.run_bounded(
            f"unmarking {directory}", lambda: remove_completion_markers(directory, storage),
        )
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
    return directories.run_bounded(f"writing common.pt of {directory}", write)


def _guarded_write(
    write: Callable[[], Any], checkpoint_dir: Union[str, Path], directories: SaveDirectories
) -> Any:
    """Run megatron-core's ``common.pt`` write behind the checks (every rank).

    Raises:
        CheckpointInProgressError: an unfinalized async save of this process still
            writes ``checkpoint_dir`` (every rank alike; nothing was written), or, with
            another strategy, the process's saves stopped (rank 0).
    """
    call = current_save_call()
    ours = call is not None and call.overwrite is not None
    directory = normalize_checkpoint_path(checkpoint_dir)
    directories.refuse_if_claimed(directory)
    if coordination.get_rank() != 0:  # megatron-core writes on rank 0 only
        return write()
    if ours and directories.stuck is not None:  # our strategy's agreed check refuses the save
        logger.warning("leaving common.pt of %s untouched: %s", checkpoint_dir, directories.stuck)
        return None
    directories.refuse_if_stuck()
    try:
        return _unmark_then_write(write, directory, directories, call.overwrite if ours else None)
    except Exception as exc:
        if not ours:
            raise  # another strategy: as megatron-core would
        logger.error("rank 0: leaving common.pt of %s for the save to fail on every rank: %s", checkpoint_dir, exc)
        call.failure = exc
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


def guard_save_common_function(module: Any, directories: SaveDirectories) -> None:
    """0.17 / 0.18: wrap ``module.save_common`` (the function ``save()`` calls) with the
    checks against ``directories`` (the process's record). Idempotent."""
    original: Callable[..., None] = module.save_common
    if getattr(original, "__megatron_async_guarded__", False):
        return

    @functools.wraps(original)
    def guarded_save_common(common_state_dict: StateDict, checkpoint_dir: Union[str, Path], *args, **kwargs):
        write = functools.partial(original, common_state_dict, checkpoint_dir, *args, **kwargs)
        return _guarded_write(write, checkpoint_dir, directories)

    guarded_save_common.__megatron_async_guarded__ = True
    module.save_common = guarded_save_common
