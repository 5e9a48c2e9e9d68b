"""``nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver``.

The difference from :mod:`megatron_async.saver.state_dict_saver` (megatron-core's
convention) is the result of planning: here it is always ``(writer, metadata,
dist_wrapper)``, and the cached plans live in a :class:`CheckpointMetadataCache` rather
than being passed in and returned. Runs on every rank, on the training thread.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron_async.core import coordination
from megatron_async.saver.metadata_cache import CheckpointMetadataCache, default_metadata_cache
from megatron_async.saver.state_dict_saver import (
    plan_save,
    save_state_dict_async_finalize,
    verify_global_md_reuse,
)
from megatron_async.writer.filesystem import FileSystemWriterAsync

__all__ = [
    "CheckpointMetadataCache",
    "init_checkpoint_metadata_cache",
    "save_state_dict_async_plan",
    "save_state_dict_async_finalize",
    "verify_global_md_reuse",
]


def init_checkpoint_metadata_cache(cached_global_metadata: Optional[Metadata] = None) -> None:
    """Seed the process-wide cache (used when ``enable_cache=True`` comes without one)."""
    default_metadata_cache().set_cached_global_metadata(cached_global_metadata)


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

    With ``enable_cache`` the plans of ``metadata_cache`` (or of the process-wide cache
    when it is None) are offered for reuse, verified against fresh local plans on every
    rank, and the cache is updated; the coordinator's metadata is the cached one when
    reused. Without it the cache is neither read nor updated.
    """
    if not enable_cache:
        return plan_save(
            state_dict, storage_writer, process_group, coordinator_rank, planner
        ).finalize_args
    cache = metadata_cache if metadata_cache is not None else default_metadata_cache()
    if process_group is not None and coordination.is_distributed():
        rank = dist.get_rank(process_group)
    else:
        rank = coordination.get_rank()
    cached_structure = None
    if cache.can_offer_cached_plans(rank == coordinator_rank):
        cached_structure = (cache.cached_central_plan, cache.cached_local_plan, True)
    result = plan_save(
        state_dict,
        storage_writer,
        process_group,
        coordinator_rank,
        planner,
        cached_ckpt_structure=cached_structure,
        loaded_all_plans=cache.loaded_all_plans,
    )
    cache.record_plan(
        result.central_plan, result.local_plan, result.reused_cached_plans, result.reused_loaded_metadata
    )
    # The fresh metadata is remembered; reused plans or loaded metadata: the cached one.
    return cache.prepare_save_state_dict_ret(rank, coordinator_rank, result.finalize_args)
