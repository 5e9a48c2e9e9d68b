"""Plan a megatron-core save, reusing the previous save's plan while the structure holds.

One :class:`PlanCache` belongs to one strategy instance and runs on every rank, on the
training thread. :meth:`PlanCache.plan_save` is the whole planning of one save, from
the sharded state dict to a prepared writer, in three tiers (cheapest first):

1. *no planning*: the sharded state dict's fingerprint equals the cached one on every
   rank (one all-reduce tells): the cached plan is rebound to the new tensors
   (:mod:`.structure`) and the cached metadata reused;
2. *cached plans*: megatron-core's translation and a local plan run, and
   :func:`~megatron_async.saver.state_dict_saver.plan_save` reuses the
   cached global plan when no rank's local plan changed;
3. *full planning*: plans are gathered and the global metadata is built anew.

A change on any rank makes every rank plan again, so a changed structure never writes
a wrong checkpoint. Without ``cached_metadata`` every save plans in full.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, TypeVar

from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from torch.distributed.checkpoint.metadata import Metadata

from megatron_async.core import coordination
from megatron_async.core.coordination import agreed_step
from megatron_async.core.gc_pause import paused_gc
from megatron_async.mcore import generation
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.mcore.structure import PlanBinding, Structure, bind_plan, describe_structure, rebind
from megatron_async.saver.metadata_cache import CheckpointMetadataCache
from megatron_async.saver.state_dict_saver import make_dist_wrapper, plan_with_cache
from megatron_async.writer.filesystem import FileSystemWriterAsync
from megatron_async.writer.commit import unmark_before_rewrite

__all__ = ["PlanCache", "PreparedSave", "COORDINATOR_RANK"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

COORDINATOR_RANK = 0
"""The rank that builds and writes the global metadata."""

PreparedSave = Tuple[FileSystemWriterAsync, Optional[Metadata], Any]
"""``(writer, global metadata or None, dist_wrapper)``, for the save's finalization."""


@dataclasses.dataclass(frozen=True)
class _CachedStructure:
    """What lets the next save skip planning (every rank, its own); the plans and the
    metadata themselves are in :attr:`PlanCache.plans`.

    Attributes:
        config: the options it was planned with; a save with other options plans afresh.
        world: ``(rank, world size)`` it was planned in.
        fingerprint: the structure of the state dict it was planned for, or None.
        binding: where the plan's items take their data from, or None (no reuse without
            planning).
    """

    config: TorchDistSaveConfig
    world: Tuple[int, int]
    fingerprint: Optional[List[tuple]]
    binding: Optional[PlanBinding]


class _LocalStep(NamedTuple):
    """What one rank's first step of a save produced (every rank, its own).

    Attributes:
        structure: the state dict's structure, or None (not cached, or not describable).
        prepared: ``(writer, dist_wrapper)`` when the cached plan was rebound, else None.
        pyt_state_dict: the translated state dict when planning is needed, else None.
        overwrites: whether this rank (the coordinator) found a complete checkpoint to
            unmark once planning is agreed.
    """

    structure: Optional[Structure]
    prepared: Optional[Tuple[FileSystemWriterAsync, Any]]
    pyt_state_dict: Optional[Dict[str, Any]] = None
    overwrites: bool = False

    @staticmethod
    def flags(step: Optional["_LocalStep"]) -> List[int]:
        """``[planning needed, reuse prepared, overwrites]`` of this rank (``[1, 0, 0]``
        after a failure)."""
        prepared = step is not None and step.prepared is not None
        return [int(not prepared), int(prepared), int(step is not None and step.overwrites)]


def fail_first_collective(error: Exception, checkpoint_dir: str) -> None:
    """Join the first collective of a save of ``checkpoint_dir`` with ``error`` (a rank that
    failed before it reached :meth:`PlanCache.plan_save`; every rank that did so): the
    ranks waiting in it and this one raise the same agreed error, naming this rank's cause.

    Raises:
        CheckpointValidationError, CheckpointInProgressError: always.
    """

    def failed() -> None:
        raise error

    agreed_step(f"async save to {checkpoint_dir}", failed, flags=_LocalStep.flags)


class PlanCache:
    """The plans of one strategy's latest save, and the policy that reuses them (every rank).

    Attributes:
        plans: the latest save's plans and, on the coordinator, its global metadata.
        last_save_reused_plans: whether the latest save reused cached plans.
        structure_reuse_count: how many saves skipped planning altogether.
    """

    def __init__(self) -> None:
        self.plans = CheckpointMetadataCache()
        self.last_save_reused_plans = False
        self.structure_reuse_count = 0
        self._cached: Optional[_CachedStructure] = None

    @property
    def cached_global_metadata(self) -> Optional[Metadata]:
        """The strategy's ``cached_global_metadata`` (see
        :attr:`~megatron_async.mcore.strategy.TorchDistAsyncSaveStrategy.cached_global_metadata`)."""
        return self.plans.cached_global_metadata

    @cached_global_metadata.setter
    def cached_global_metadata(self, metadata: Optional[Metadata]) -> None:
        if metadata is not self.plans.cached_global_metadata:  # the same one keeps the plans
            self.plans.set_cached_global_metadata(metadata)
            self._cached = None

    @paused_gc()  # thousands of short-lived tuples and lists per save; no cycles
    def plan_save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: str,
        config: TorchDistSaveConfig,
        create_writer: Callable[[], FileSystemWriterAsync],
        check_target: Callable[[], bool],
    ) -> PreparedSave:
        """Plan one save and prepare its writer (every rank, collective).

        Args:
            sharded_state_dict: megatron-core sharded state dict.
            checkpoint_dir: the target, for messages.
            config: the strategy's options.
            create_writer: returns this save's storage writer.
            check_target: raises if this rank cannot save; its failure on any rank is
                agreed on in the save's first collective. Returns whether a complete
                checkpoint is there to unmark (coordinator): once every rank planned,
                the coordinator unmarks it in one more agreed step.

        Raises:
            CheckpointValidationError, CheckpointInProgressError: on every rank, when a
                check or the planning failed on any rank.
        """
        cached = self._usable(config)

        def local_step() -> _LocalStep:
            overwrites = check_target()
            structure = None
            if config.cached_metadata:
                previous = cached.fingerprint if cached is not None else None
                structure = _optional(
                    lambda: describe_structure(sharded_state_dict, previous),
                    "cannot fingerprint the sharded state dict; planning in full",
                )
            binding = cached.binding if cached is not None else None
            if (
                binding is not None
                and structure is not None
                and structure.fingerprint is cached.fingerprint
            ):
                # Every rank's reuse is agreed before the write is scheduled.
                writer, dist_wrapper = create_writer(), make_dist_wrapper(None, COORDINATOR_RANK)
                writer.set_up_storage_writer(dist_wrapper.is_coordinator, rank=dist_wrapper.rank)
                writer.prepare_resolved_write_data(
                    self.plans.cached_central_plan, rebind(binding, structure), binding.layout,
                    binding.staging_key,
                )
                return _LocalStep(structure, (writer, dist_wrapper), overwrites=overwrites)
            pyt_state_dict = generation.to_dcp_state_dict(sharded_state_dict, config)
            return _LocalStep(structure, None, pyt_state_dict, overwrites)

        # The one collective of a save with an unchanged structure: did any rank fail, did
        # any rank's structure change, did any rank prepare a reuse, is a checkpoint there?
        step, (changed, any_prepared, overwrites) = agreed_step(
            f"async save to {checkpoint_dir}", local_step, flags=_LocalStep.flags
        )
        if not changed:
            writer, dist_wrapper = step.prepared
            self.structure_reuse_count += 1
            self.last_save_reused_plans = True
            logger.debug("rank %d: structure unchanged on every rank; no planning", dist_wrapper.rank)
            prepared = writer, self.plans.cached_global_metadata, dist_wrapper
        else:
            pyt_state_dict = step.pyt_state_dict
            if any_prepared:  # planning in full after all: translate where it was skipped

                def translate() -> Dict[str, Any]:
                    if pyt_state_dict is not None:
                        return pyt_state_dict
                    return generation.to_dcp_state_dict(sharded_state_dict, config)

                pyt_state_dict, _ = agreed_step(f"translating the state dict for {checkpoint_dir}", translate)
            prepared = self._plan(pyt_state_dict, config, step.structure, cached, create_writer())
        if overwrites:  # planned on every rank: now the complete checkpoint there may go
            coordination.run_on_coordinator(
                "prepare", lambda: unmark_before_rewrite(checkpoint_dir, strict=True), checkpoint_dir
            )
        return prepared

    def _usable(self, config: TorchDistSaveConfig) -> Optional[_CachedStructure]:
        """Return the latest save's structure if this save may reuse its plans (every
        rank, local).

        The coordinator's cached metadata is never None then: a planning that caches
        either built it or reused a metadata that was there.
        """
        cached = self._cached
        if cached is None or not config.cached_metadata or cached.config != config:
            return None
        if cached.world != (coordination.get_rank(), coordination.get_world_size()):
            return None
        return cached

    def _plan(
        self,
        pyt_state_dict: Dict[str, Any],
        config: TorchDistSaveConfig,
        structure: Optional[Structure],
        cached: Optional[_CachedStructure],
        writer: FileSystemWriterAsync,
    ) -> PreparedSave:
        """Plan the save in full (every rank), reusing verified plans where it can."""
        self._cached = None  # until this planning succeeds: never keep an older one
        if cached is None:  # planned with other options, or failed: not offered
            self.plans.cached_central_plan = self.plans.cached_local_plan = None
        # Without cached_metadata every save plans in full, in a cache of its own.
        # Not vouched for: the structure may have changed, so the cached plans are reused
        # only if a fresh local plan matches them on every rank. The caller unmarks, agreed.
        result = plan_with_cache(
            self.plans if config.cached_metadata else CheckpointMetadataCache(),
            pyt_state_dict, writer, coordinator_rank=COORDINATOR_RANK,
            planner=generation.create_save_planner(config), vouched=False, unmark=False,
        )
        self.last_save_reused_plans = result.reused_cached_plans
        binding = None
        if structure is not None and result.prepared_write is not None:  # for the next saves
            binding = _optional(
                lambda: bind_plan(
                    structure, result.central_plan, result.prepared_write, config.keep_only_main_replica
                ),
                "cannot bind the plan to the state dict's structure; later saves plan in full",
                logging.WARNING,
            )
        self._cached = _CachedStructure(
            config=config,
            world=(coordination.get_rank(), coordination.get_world_size()),
            fingerprint=structure.fingerprint if structure is not None else None,
            binding=binding,
        )
        return result.finalize_args


def _optional(step: Callable[[], T], failure: str, level: int = logging.DEBUG) -> Optional[T]:
    """Run a step of the planless path (every rank, local), or log ``failure`` and return
    None if it raised: an optimization only, whose absence makes saves plan in full."""
    try:
        return step()
    except Exception:
        logger.log(level, "rank %d: %s", coordination.get_rank(), failure, exc_info=True)
        return None
