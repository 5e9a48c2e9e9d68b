"""Check that one save may write into its target directory (every rank, local).

:class:`~megatron_async.mcore.strategy.TorchDistAsyncSaveStrategy` claims the directory
and runs :func:`check_save_target` on every rank in the local step of its first
collective, so a refusal on any rank becomes the same error on every rank. Nothing here
runs a collective or talks to another rank.

A complete checkpoint in the target is refused with ``overwrite=False``; otherwise its
completion markers are removed once planning is agreed (docs/design.md, "Overwriting a
complete checkpoint"), except in an object store (no rename, and a listing per save would
cost requests), where they are removed here.

The strategy runs the file-system checks within half the coordination timeout on a helper
thread (:meth:`~megatron_async.core.save_directories.SaveDirectories.run_bounded`).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from megatron_async.core import coordination
from megatron_async.errors import CheckpointValidationError
from megatron_async.checkpoint_dirs import is_complete_checkpoint
from megatron_async.format import DCP_METADATA_FILE, remove_completion_markers
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.storage.backend import CheckpointStorage, storage_for
from megatron_async.storage.client import MSC_EXTRA_HINT

__all__ = ["check_save_target", "unmark_or_refuse"]

logger = logging.getLogger(__name__)


def check_save_target(checkpoint_dir: str, config: TorchDistSaveConfig, is_coordinator: bool) -> bool:
    """Raise if this rank cannot save into ``checkpoint_dir`` (every rank, local; file-system
    calls only, which the caller bounds).

    Returns:
        Whether the coordinator found a complete checkpoint to unmark once planning is
        agreed (a local directory with ``overwrite``; False on the other ranks).

    Args:
        checkpoint_dir: the normalized target (a local path or an object-storage URL).
        config: the strategy's options (``overwrite``, ``use_msc``).
        is_coordinator: whether this rank handles an existing checkpoint.

    Raises:
        CheckpointValidationError: the target cannot be created, is not a directory, is not writable,
            an object-storage URL without ``use_msc``, or a complete checkpoint with
            ``overwrite=False``.
    """
    rank = coordination.get_rank()
    storage = storage_for(checkpoint_dir)
    if storage.needs_msc:  # no directories or permissions to probe in a store
        if not config.use_msc:
            raise CheckpointValidationError(
                f"{checkpoint_dir} is an object-storage URL; create the strategy with "
                f"use_msc=True ({MSC_EXTRA_HINT})"
            )
        if is_coordinator:
            unmark_or_refuse(checkpoint_dir, config.overwrite, storage)
        return False
    if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
        raise CheckpointValidationError(
            f"rank {rank}: checkpoint path {checkpoint_dir} is not a directory"
        )
    try:  # a new directory per save, as Megatron-LM's iteration directories
        os.makedirs(checkpoint_dir, exist_ok=True)
    except OSError as exc:
        raise CheckpointValidationError(
            f"rank {rank}: cannot create the checkpoint directory {checkpoint_dir} ({exc}); "
            "save into a directory this rank can create or write"
        ) from exc
    if not os.access(checkpoint_dir, os.W_OK | os.X_OK):
        raise CheckpointValidationError(
            f"rank {rank}: checkpoint directory {checkpoint_dir} is not writable"
        )
    marker = os.path.join(checkpoint_dir, DCP_METADATA_FILE)
    complete = is_coordinator and os.path.exists(marker)
    if complete and not config.overwrite:
        raise CheckpointValidationError(
            f"{checkpoint_dir} already holds a complete torch_dist checkpoint ({marker} "
            "exists) and overwrite=False; save into a new directory or delete it first"
        )
    return complete


def unmark_or_refuse(directory: str, overwrite: Optional[bool], storage: CheckpointStorage) -> None:
    """Refuse a complete checkpoint in ``directory`` under ``overwrite=False``; otherwise
    remove its completion markers, with a warning, so that it reads as incomplete until the
    new save is finalized (coordinator; file-system calls only, the caller bounds them).

    ``overwrite`` None (another strategy's save, megatron-core's ``common.pt`` write)
    never refuses.

    Raises:
        CheckpointValidationError: a complete checkpoint under ``overwrite=False``, or one
            this user may not change.
    """
    if overwrite is False and is_complete_checkpoint(directory, storage):
        raise CheckpointValidationError(
            f"{directory} already holds a complete torch_dist checkpoint and overwrite=False; "
            "save into a new directory (a new prefix in an object store) or delete it first"
        )
    try:
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
