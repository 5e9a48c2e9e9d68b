"""Protect ``common.pt`` of checkpoints that are still being written or already complete.

megatron-core's ``dist_checkpointing.save`` writes ``common.pt`` (rank 0, synchronously)
*before* it calls the sharded save strategy. A sharded strategy alone therefore comes too
late to protect a checkpoint directory:

* a second save into a directory that an async save is still writing would replace the
  first save's ``common.pt`` before the strategy can refuse it;
* overwriting a complete checkpoint would put a new ``common.pt`` next to the old
  completion markers, so a crash right then leaves a mixed checkpoint that looks complete.

:class:`GuardedCommonSaveStrategy` is megatron-core's ``torch`` common-save strategy with
those two checks in front; :func:`megatron_async.mcore.generation.register_strategies`
registers it as megatron-core's default (the registry entry ``dist_checkpointing.save``
uses), so every ``dist_checkpointing.save`` of the process gets the protection, whatever
its sharded strategy. Registry generation (megatron-core 0.16.x) only: later generations
store the common state inside the checkpoint. It runs on every rank; each rank decides from its own record of in-flight
saves, which is the same on all ranks because every rank schedules the same saves.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Union

from megatron.core.dist_checkpointing.mapping import StateDict
from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy

from megatron_async.errors import CheckpointInProgressError
from megatron_async.format import remove_completion_markers
from megatron_async.mcore.in_flight import checkpoints_in_flight
from megatron_async.storage.locations import normalize_checkpoint_path

__all__ = ["GuardedCommonSaveStrategy"]

logger = logging.getLogger(__name__)


class GuardedCommonSaveStrategy(TorchCommonSaveStrategy):
    """megatron-core's ``torch`` common-save strategy that refuses unsafe targets first."""

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]) -> None:
        """Check the target, then write ``common.pt`` as megatron-core does (rank 0).

        Raises:
            CheckpointInProgressError: an unfinalized async save of this process still
                writes ``checkpoint_dir``; nothing was written.
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

        if dist.get_rank() == 0:
            self._unmark_complete_checkpoint(directory)
        super().save_common(common_state_dict, checkpoint_dir)

    @staticmethod
    def _unmark_complete_checkpoint(directory: str) -> None:
        """Remove the completion markers before anything of the old checkpoint changes."""
        if remove_completion_markers(directory):
            logger.warning(
                "overwriting the checkpoint in %s: its completion markers were removed first, "
                "so it reads as incomplete until the new save is finalized",
                directory,
            )
