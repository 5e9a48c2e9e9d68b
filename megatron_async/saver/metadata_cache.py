"""What one save remembers for the next: plans and global metadata (every rank, its own).

:class:`CheckpointMetadataCache` is the object that megatron-core 0.17+ hands to
``save_state_dict_async_plan(..., enable_cache=True, metadata_cache=cache)`` (the
nvidia-resiliency-ext module set). It keeps the latest save's global plan and local plan
and, on the coordinator, the global metadata, so that a save whose structure is unchanged
skips the plan gather and the metadata build.

Reuse is decided by :func:`~megatron_async.saver.state_dict_saver.plan_save` (called by
:func:`megatron_async.nvrx.state_dict_saver.save_state_dict_async_plan`) against fresh
local plans on every rank, never from these flags alone: a cache that says
"validated" cannot make a changed structure write stale metadata.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from megatron_async.saver.plan_digests import loaded_plans

__all__ = ["CheckpointMetadataCache", "default_metadata_cache"]

logger = logging.getLogger(__name__)


class CheckpointMetadataCache:
    """Plans and metadata of the latest save of one saver (every rank).

    Attributes:
        cached_central_plan: this rank's final plan of the latest save.
        cached_local_plan: this rank's local plan of the latest save.
        cached_global_metadata: the global metadata, on the coordinator (elsewhere
            whatever was set); a loaded checkpoint's metadata may be put here with
            :meth:`set_cached_global_metadata`.
        validated_cache_reuse: whether the latest save reused the cached plans.
        validated_loaded_metadata_reuse: whether the latest save reused the loaded
            checkpoint's metadata.
        loaded_all_plans: what that loaded metadata says of every rank's local plan
            (digests or plans, see :func:`~megatron_async.saver.plan_digests.loaded_plans`),
            or None.
    """

    def __init__(self) -> None:
        self.cached_central_plan: Optional[SavePlan] = None
        self.cached_local_plan: Optional[SavePlan] = None
        self.cached_global_metadata: Optional[Metadata] = None
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False
        self.loaded_all_plans: Optional[List[SavePlan]] = None

    def set_cached_global_metadata(self, cached_global_metadata: Optional[Metadata]) -> None:
        """Seed the cache with a loaded checkpoint's metadata (every rank).

        Its plan digests (written by our saver) or ``all_local_plans`` (megatron-core's,
        older versions of ours) let the first save of a resumed job skip the plan
        gather when every rank's plan matches.
        """
        self.cached_global_metadata = cached_global_metadata
        self.loaded_all_plans = loaded_plans(cached_global_metadata)
        if cached_global_metadata is not None and self.loaded_all_plans is None:
            logger.debug("loaded metadata has no plans of the ranks; the first save plans in full")

    def get_cache_metadata(
        self,
    ) -> Tuple[Optional[SavePlan], Optional[SavePlan], bool, Optional[List[SavePlan]]]:
        """Return ``(central plan, local plan, validated_cache_reuse, loaded_all_plans)``."""
        return (
            self.cached_central_plan,
            self.cached_local_plan,
            self.validated_cache_reuse,
            self.loaded_all_plans,
        )

    def can_offer_cached_plans(self, is_coordinator: bool) -> bool:
        """Whether this rank may offer its cached plans for reuse (every rank, local).

        The coordinator offers them only while it holds the metadata that goes with
        them; otherwise it asks for a fresh plan, and with it every rank plans afresh.
        """
        if self.cached_central_plan is None:
            return False
        return self.cached_global_metadata is not None or not is_coordinator

    def set_cache_metadata(
        self, central_plan: SavePlan, local_plan: SavePlan, global_md_verify_reuse: bool
    ) -> None:
        """Remember a save's plans (every rank, after planning).

        ``validated_cache_reuse`` becomes whether the new global plan equals the
        cached one.
        """
        self.validated_loaded_metadata_reuse = bool(global_md_verify_reuse)
        self.validated_cache_reuse = central_plan == self.cached_central_plan
        self.cached_central_plan = central_plan
        self.cached_local_plan = local_plan

    def record_plan(
        self,
        central_plan: SavePlan,
        local_plan: SavePlan,
        reused_cached_plans: bool,
        reused_loaded_metadata: bool,
    ) -> None:
        """Remember a save's plans and how they were made (every rank, after
        :func:`save_state_dict_async_plan` planned); its metadata goes through
        :meth:`prepare_save_state_dict_ret`."""
        self.validated_loaded_metadata_reuse = bool(reused_loaded_metadata)
        self.validated_cache_reuse = bool(reused_cached_plans)
        self.cached_central_plan = central_plan
        self.cached_local_plan = local_plan

    def prepare_save_state_dict_ret(self, rank: int, coordinator: int, save_state_dict_ret):
        """Fill the cached metadata into a planning result that has none (every rank).

        ``save_state_dict_ret`` is ``(writer, metadata or None, dist_wrapper)``; on the
        coordinator a missing metadata is replaced by the cached one, and fresh metadata
        is remembered for the next save.
        """
        writer, metadata, dist_wrapper = save_state_dict_ret
        if metadata is not None:
            self.cached_global_metadata = metadata
        elif rank == coordinator:
            metadata = self.cached_global_metadata
        return writer, metadata, dist_wrapper


_DEFAULT_CACHE: Optional[CheckpointMetadataCache] = None


def default_metadata_cache() -> CheckpointMetadataCache:
    """The process-wide cache used when ``enable_cache=True`` comes without a cache object."""
    global _DEFAULT_CACHE
    if _DEFAULT_CACHE is None:
        _DEFAULT_CACHE = CheckpointMetadataCache()
    return _DEFAULT_CACHE
