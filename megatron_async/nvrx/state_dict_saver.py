"""``nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver``.

Planning here always takes nvidia-resiliency-ext's convention of
:func:`megatron_async.saver.state_dict_saver.save_state_dict_async_plan`: the result is
``(writer, metadata, dist_wrapper)``, and the cached plans live in a
:class:`CheckpointMetadataCache` rather than being passed in and returned. Runs on every
rank, on the training thread.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron_async.saver.metadata_cache import CheckpointMetadataCache, default_metadata_cache
from megatron_async.saver import state_dict_saver as _saver
from megatron_async.saver.state_dict_saver import save_state_dict_async_finalize, verify_global_md_reuse
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

    nvidia-resiliency-ext's argument order for
    :func:`megatron_async.saver.state_dict_saver.save_state_dict_async_plan`'s
    cached convention.
    """
    return _saver.save_state_dict_async_plan(
        state_dict, storage_writer, process_group, coordinator_rank, planner,
        enable_cache=bool(enable_cache), metadata_cache=metadata_cache,
    )
