"""Public import path of the async save steps, as megatron-core names it.

``megatron.core.dist_checkpointing.strategies.state_dict_saver`` users switch by
importing from here; the implementation lives in :mod:`megatron_async.saver`.
:func:`save_state_dict_async_plan` here also takes nvidia-resiliency-ext's calling
convention (``enable_cache`` / ``metadata_cache``), which
:mod:`megatron_async.nvrx.state_dict_saver` implements.
"""

from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from megatron_async.nvrx import state_dict_saver as _nvrx_saver
from megatron_async.saver import state_dict_saver as _saver
from megatron_async.saver.metadata_cache import CheckpointMetadataCache
from megatron_async.saver.state_dict_saver import (
    CachedStructure,
    save_state_dict_async_finalize,
    verify_global_md_reuse,
)
from megatron_async.writer.filesystem import FileSystemWriterAsync

__all__ = ["save_state_dict_async_plan", "save_state_dict_async_finalize", "verify_global_md_reuse"]


def save_state_dict_async_plan(
    state_dict: STATE_DICT_TYPE,
    storage_writer: FileSystemWriterAsync,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    planner: Optional[SavePlanner] = None,
    cached_ckpt_structure: Optional[CachedStructure] = None,
    loaded_all_plans: Optional[List[SavePlan]] = None,
    enable_cache: Optional[bool] = None,
    metadata_cache: Optional[CheckpointMetadataCache] = None,
):
    """Plan a save and prepare the writer's buckets (every rank, synchronous).

    Two calling conventions share this entry point:

    * megatron-core's (``cached_ckpt_structure`` / ``loaded_all_plans``): returns
      ``((writer, metadata or None, dist_wrapper), central_plan, local_plan,
      reused_cached_plans, reused_loaded_metadata)``, see
      :func:`megatron_async.saver.state_dict_saver.save_state_dict_async_plan`;
    * nvidia-resiliency-ext's, chosen by passing ``enable_cache`` or ``metadata_cache``:
      the cached plans live in a :class:`CheckpointMetadataCache` (the process-wide one
      when ``enable_cache=True`` comes without one) and the result is only
      ``(writer, metadata, dist_wrapper)``, see
      :func:`megatron_async.nvrx.state_dict_saver.save_state_dict_async_plan`. With
      ``enable_cache=False`` the cache is neither read nor updated.

    Raises:
        CheckpointValidationError: on every rank, when planning failed on any rank
            (for example overlapping or missing shards).
    """
    if enable_cache is not None or metadata_cache is not None:
        return _nvrx_saver.save_state_dict_async_plan(
            state_dict, storage_writer, process_group, coordinator_rank, planner,
            bool(enable_cache), metadata_cache,
        )
    return _saver.save_state_dict_async_plan(
        state_dict, storage_writer, process_group, coordinator_rank, planner,
        cached_ckpt_structure, loaded_all_plans,
    )
