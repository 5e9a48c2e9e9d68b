"""``nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver``.

Planning here takes nvidia-resiliency-ext's convention: the result is ``(writer,
metadata, dist_wrapper)``, and the cached plans live in a :class:`CheckpointMetadataCache`
rather than being passed in and returned. Runs on every rank, on the training thread.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron_async.saver.finalize import save_state_dict_async_finalize
from megatron_async.saver.metadata_cache import CheckpointMetadataCache, verify_global_md_reuse
from megatron_async.saver.state_dict_saver import plan_save, plan_with_cache
from megatron_async.writer.filesystem import FileSystemWriterAsync

__all__ = [
    "CheckpointMetadataCache",
    "init_checkpoint_metadata_cache",
    "save_state_dict_async_plan",
    "save_state_dict_async_finalize",
    "verify_global_md_reuse",
]


_PROCESS_CACHE = CheckpointMetadataCache()
"""The cache of ``enable_cache=True`` without a ``metadata_cache`` (nvidia-resiliency-ext's
process-wide one)."""


def init_checkpoint_metadata_cache(cached_global_metadata: Optional[Metadata] = None) -> None:
    """Seed the process-wide cache (used when ``enable_cache=True`` comes without one)."""
    _PROCESS_CACHE.set_cached_global_metadata(cached_global_metadata)


def save_state_dict_async_plan(
    state_dict: STATE_DICT_TYPE,
    storage_writer: FileSystemWriterAsync,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    planner: Optional[SavePlanner] = None,
    enable_cache: bool = False,
    metadata_cache: Optional[CheckpointMetadataCache] = None,
) -> Tuple[FileSystemWriterAsync, Optional[Metadata], _DistWrapper]:
    """Plan a save and prepare the writer (every rank); pass the result to finalize.

    With ``enable_cache`` (a promise that the structure does not change) the plans of
    ``metadata_cache`` (the process-wide one when None) are reused
    (:func:`~megatron_async.saver.state_dict_saver.plan_with_cache`); without it the
    cache is neither read nor updated.
    """
    if not enable_cache:
        return plan_save(state_dict, storage_writer, process_group, coordinator_rank, planner).finalize_args
    cache = metadata_cache if metadata_cache is not None else _PROCESS_CACHE
    return plan_with_cache(
        cache, state_dict, storage_writer, process_group, coordinator_rank, planner, vouched=True
    ).finalize_args
