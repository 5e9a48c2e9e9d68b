"""What one save remembers for the next: plans and global metadata (every rank, its own).

:class:`CheckpointMetadataCache` is the one cache of plans and global metadata: the
megatron-core strategy keeps one (:mod:`megatron_async.mcore.plan_cache`), and
megatron-core 0.17+ hands one to ``save_state_dict_async_plan(..., enable_cache=True,
metadata_cache=cache)`` (the nvidia-resiliency-ext module set). Both plan through
:func:`~megatron_async.saver.state_dict_saver.plan_with_cache`, which offers the cached
plans and a loaded checkpoint's plan digests for reuse and records the outcome here.

Reuse is decided by :func:`~megatron_async.saver.state_dict_saver.plan_save` against
fresh local plans on every rank, never from these flags alone: a cache that says
"validated" cannot make a changed structure write stale metadata.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from megatron_async.saver.plan_digests import loaded_plans

__all__ = ["CheckpointMetadataCache"]


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
    """

    def __init__(self) -> None:
        self.cached_central_plan: Optional[SavePlan] = None
        self.cached_local_plan: Optional[SavePlan] = None
        self.cached_global_metadata: Optional[Metadata] = None
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False

    @property
    def loaded_all_plans(self) -> Optional[List[Any]]:
        """What the cached metadata says of every rank's local plan (digests or plans, see
        :func:`~megatron_async.saver.plan_digests.loaded_plans`), or None."""
        return loaded_plans(self.cached_global_metadata)

    def set_cached_global_metadata(self, cached_global_metadata: Optional[Metadata]) -> None:
        """Seed the cache with a loaded checkpoint's metadata (every rank).

        Its plan digests (written by our saver) or ``all_local_plans`` (megatron-core's,
        older versions of ours) let the first save of a resumed job skip the plan
        gather when every rank's plan matches. Cached plans are dropped: they were made
        with another metadata, which this one may not describe.
        """
        self.cached_global_metadata = cached_global_metadata
        self.cached_central_plan = self.cached_local_plan = None

    def get_cache_metadata(
        self,
    ) -> Tuple[Optional[SavePlan], Optional[SavePlan], bool, Optional[List[Any]]]:
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

    def record_plan(
        self,
        central_plan: SavePlan,
        local_plan: SavePlan,
        reused_cached_plans: bool,
        reused_loaded_metadata: bool,
    ) -> None:
        """Remember a save's plans and how they were made (every rank, after planning);
        its metadata goes through :meth:`prepare_save_state_dict_ret`."""
        self.validated_loaded_metadata_reuse = bool(reused_loaded_metadata)
        self.validated_cache_reuse = bool(reused_cached_plans)
        self.cached_central_plan = central_plan
        self.cached_local_plan = local_plan

    def prepare_save_state_dict_ret(self, rank: int, coordinator: int, save_state_dict_ret):
        """Fill the cached metadata into a planning result that reused it (every rank,
        after :meth:`record_plan`).

        ``save_state_dict_ret`` is ``(writer, metadata or None, dist_wrapper)``. When the
        plans or the loaded metadata were reused, the coordinator's metadata is the
        cached one (None elsewhere). Otherwise the result's metadata is remembered on
        every rank, None off the coordinator, so that no rank later checks its plan
        against the digests of another save than the coordinator's.
        """
        writer, metadata, dist_wrapper = save_state_dict_ret
        if self.validated_cache_reuse or self.validated_loaded_metadata_reuse:
            metadata = self.cached_global_metadata if rank == coordinator else None
        else:
            self.cached_global_metadata = metadata
        return writer, metadata, dist_wrapper

