"""Plan a megatron-core save, reusing the previous save's plan while the structure holds.

One :class:`PlanCache` belongs to one strategy instance and runs on every rank, on the
training thread. :meth:`PlanCache.plan_save` is the whole planning of one save, from
the sharded state dict to a prepared writer, in three tiers (cheapest first):

1. *no planning*: the sharded state dict's fingerprint equals the cached one on every
   rank (one all-reduce tells): the cached plan is rebound to the new tensors
   (:mod:`.structure`) and the cached metadata reused;
2. *cached plans*: megatron-core's translation and a local plan run, and
   :func:`~megatron_async.saver.state_dict_saver.save_state_dict_async_plan` reuses the
   cached global plan when no rank's local plan changed;
3. *full planning*: plans are gathered and the global metadata is built anew.

A change on any rank makes every rank plan again, so a changed structure never writes
a wrong checkpoint. Without ``cached_metadata`` every save plans in full.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from megatron_async.core import coordination
from megatron_async.mcore import generation
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.mcore.structure import PlanBinding, Structure, bind_plan, describe_structure, rebind
from megatron_async.saver.agreement import agree_or_raise
from megatron_async.saver.state_dict_saver import prepare_cached_write, save_state_dict_async_plan
from megatron_async.writer.filesystem import FileSystemWriterAsync

__all__ = ["PlanCache", "PreparedSave", "COORDINATOR_RANK"]

logger = logging.getLogger(__name__)

COORDINATOR_RANK = 0
"""The rank that builds and writes the global metadata."""

PreparedSave = Tuple[FileSystemWriterAsync, Optional[Metadata], Any]
"""``(writer, global metadata or None, dist_wrapper)``, for the save's finalization."""


@dataclasses.dataclass(frozen=True)
class _CachedPlan:
    """What the next save may reuse from the latest one (every rank, its own).

    Attributes:
        config: the options it was planned with; a save with other options plans afresh.
        world: ``(rank, world size)`` it was planned in.
        metadata: the global metadata on the coordinator (elsewhere whatever
            ``cached_global_metadata`` was); reused only while it is still that object.
        central_plan: this rank's final plan.
        local_plan: this rank's local plan, compared with a fresh one when the
            fingerprint changed.
        fingerprint: the structure of the state dict it was planned for, or None.
        binding: where the plan's items take their data from, or None (no reuse without
            planning).
    """

    config: TorchDistSaveConfig
    world: Tuple[int, int]
    metadata: Optional[Metadata]
    central_plan: SavePlan
    local_plan: SavePlan
    fingerprint: Optional[List[tuple]]
    binding: Optional[PlanBinding]


class PlanCache:
    """The plans of one strategy's latest save, and the policy that reuses them (every rank).

    Attributes:
        cached_global_metadata: with ``cached_metadata``, the metadata the coordinator
            reuses while the structure is unchanged; a loaded checkpoint's metadata may
            be put here to let the first save of a resumed job skip the plan gather.
        last_save_reused_plans: whether the latest save reused cached plans.
        structure_reuse_count: how many saves skipped planning altogether.
    """

    def __init__(self) -> None:
        self.cached_global_metadata: Optional[Metadata] = None
        self.last_save_reused_plans = False
        self.structure_reuse_count = 0
        self._cached: Optional[_CachedPlan] = None

    def plan_save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: str,
        config: TorchDistSaveConfig,
        create_writer: Callable[[], FileSystemWriterAsync],
        check_target: Callable[[], None],
    ) -> PreparedSave:
        """Plan one save and prepare its writer (every rank, collective).

        Args:
            sharded_state_dict: megatron-core sharded state dict.
            checkpoint_dir: the target, for messages.
            config: the strategy's options.
            create_writer: returns this save's storage writer.
            check_target: raises if this rank cannot save; its failure on any rank is
                agreed on in the save's first collective.

        Raises:
            CheckpointValidationError, CheckpointInProgressError: on every rank, when a
                check or the planning failed on any rank.
        """
        group = coordination.get_coordination_group()
        is_coordinator = coordination.get_rank() == COORDINATOR_RANK
        cached = self._usable(config, is_coordinator)
        structure: Optional[Structure] = None
        prepared, pyt_state_dict, error = None, None, None
        try:
            check_target()
            if config.cached_metadata:
                structure = self._describe(sharded_state_dict, cached)
            if (
                cached is not None
                and cached.binding is not None
                and structure is not None
                and structure.fingerprint is cached.fingerprint
            ):
                prepared = self._prepare_from_cache(cached, structure, create_writer())
            else:
                pyt_state_dict = generation.to_dcp_state_dict(sharded_state_dict, config)
        except Exception as exc:  # agreed on below, so that no rank waits for a failed one
            error = exc
        # The one collective of a save with an unchanged structure: did any rank fail, did
        # any rank's structure change, did any rank prepare a reuse?
        changed, any_prepared = agree_or_raise(
            error, f"async save to {checkpoint_dir}", [int(prepared is None), int(prepared is not None)], group
        )
        if not changed:
            writer, dist_wrapper = prepared
            self.structure_reuse_count += 1
            self.last_save_reused_plans = True
            logger.debug("rank %d: structure unchanged on every rank; no planning", dist_wrapper.rank)
            return writer, cached.metadata, dist_wrapper
        if any_prepared:  # planning in full after all: translate where it was skipped
            error = None
            try:
                if pyt_state_dict is None:
                    pyt_state_dict = generation.to_dcp_state_dict(sharded_state_dict, config)
            except Exception as exc:  # agreed on below
                error = exc
            agree_or_raise(error, f"translating the state dict for {checkpoint_dir}", (), group)
        return self._plan(pyt_state_dict, config, structure, cached, create_writer())

    def _usable(self, config: TorchDistSaveConfig, is_coordinator: bool) -> Optional[_CachedPlan]:
        """Return the latest save's plans if this save may reuse them (every rank, local)."""
        cached = self._cached
        if cached is None or not config.cached_metadata or cached.config != config:
            return None
        if cached.world != (coordination.get_rank(), coordination.get_world_size()):
            return None
        # Replaced by the user (a loaded checkpoint's metadata, for instance): that
        # metadata is verified against fresh plans instead.
        if cached.metadata is not self.cached_global_metadata:
            return None
        if is_coordinator and cached.metadata is None:
            return None  # without metadata to reuse, force a fresh plan on every rank
        return cached

    @staticmethod
    def _describe(
        sharded_state_dict: ShardedStateDict, cached: Optional[_CachedPlan]
    ) -> Optional[Structure]:
        """Fingerprint the state dict against the cached one (every rank, local)."""
        try:
            return describe_structure(
                sharded_state_dict, cached.fingerprint if cached is not None else None
            )
        except Exception:  # an optimization only: what it cannot describe is planned in full
            logger.debug(
                "rank %d: cannot fingerprint the sharded state dict; planning in full",
                coordination.get_rank(),
                exc_info=True,
            )
            return None

    @staticmethod
    def _prepare_from_cache(
        cached: _CachedPlan, structure: Structure, writer: FileSystemWriterAsync
    ) -> Tuple[FileSystemWriterAsync, Any]:
        """Bind this save's data to the cached plan and prepare its writer (every rank, local)."""
        binding = cached.binding
        return prepare_cached_write(
            writer,
            cached.central_plan,
            rebind(binding, structure),
            binding.layout,
            binding.staging_key,
            coordinator_rank=COORDINATOR_RANK,
        )

    def _plan(
        self,
        pyt_state_dict: Dict[str, Any],
        config: TorchDistSaveConfig,
        structure: Optional[Structure],
        cached: Optional[_CachedPlan],
        writer: FileSystemWriterAsync,
    ) -> PreparedSave:
        """Plan the save in full (every rank), reusing verified plans where it can."""
        self._cached = None  # until this planning succeeds: never keep an older one
        loaded_all_plans = (
            getattr(self.cached_global_metadata, "all_local_plans", None)
            if config.cached_metadata
            else None
        )
        (writer, metadata, dist_wrapper), central, local, reused, reused_loaded = (
            save_state_dict_async_plan(
                pyt_state_dict,
                writer,
                planner=generation.create_save_planner(config),
                coordinator_rank=COORDINATOR_RANK,
                # Not vouched for (False): the structure may have changed, so the cached
                # plans are reused only if a fresh local plan matches them on every rank.
                cached_ckpt_structure=(
                    (cached.central_plan, cached.local_plan, False) if cached is not None else None
                ),
                loaded_all_plans=loaded_all_plans,
            )
        )
        self.last_save_reused_plans = reused
        if config.cached_metadata:
            if reused or reused_loaded:
                metadata = self.cached_global_metadata
            else:
                self.cached_global_metadata = metadata
            self._cached = _CachedPlan(
                config=config,
                world=(coordination.get_rank(), coordination.get_world_size()),
                metadata=metadata,
                central_plan=central,
                local_plan=local,
                fingerprint=structure.fingerprint if structure is not None else None,
                binding=self._bind(structure, central, writer, config),
            )
        return writer, metadata, dist_wrapper

    @staticmethod
    def _bind(
        structure: Optional[Structure],
        central: SavePlan,
        writer: FileSystemWriterAsync,
        config: TorchDistSaveConfig,
    ) -> Optional[PlanBinding]:
        """Bind the plan to the structure, for the next saves (every rank, local)."""
        if structure is None:
            return None
        try:
            return bind_plan(
                structure,
                central,
                writer.write_buckets,
                writer.bucket_layout,
                writer.staging_key,
                config.keep_only_main_replica,
            )
        except Exception:  # an optimization only: this save goes on, the next ones plan in full
            logger.warning(
                "rank %d: cannot bind the plan to the state dict's structure; later saves "
                "plan in full",
                coordination.get_rank(),
                exc_info=True,
            )
            return None
