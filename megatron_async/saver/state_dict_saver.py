"""Plan an asynchronous PyTorch DCP save, with every collective on gloo.

``torch.distributed.checkpoint.save`` plans, writes and commits in one call. An
asynchronous save splits it: :func:`plan_save` (every rank, synchronous; this module)
plans and prepares the writer's buckets; the writer's save function writes the data in
the background; :func:`save_state_dict_async_finalize`
(:mod:`megatron_async.saver.finalize`) commits it once every rank wrote.

Each planning step that may fail on some ranks only runs as an
:func:`~megatron_async.core.coordination.agreed_step`, so that every rank raises the same
error instead of waiting in the next collective. All collectives run on the library's
gloo coordination group, never on CUDA tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, List, Optional, Tuple, Union

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron_async.core import coordination
from megatron_async.core.coordination import agreed_step
from megatron_async.core.save_directories import SaveDirectories
from megatron_async.core.gc_pause import paused_gc
from megatron_async.errors import CheckpointValidationError
from megatron_async.saver.global_metadata import (
    build_global_metadata, plans_globally_like_dcp, share_equal_sizes, without_redundant_empty_chunks,
)
from megatron_async.saver.metadata_cache import (
    CheckpointMetadataCache, plan_digest, same_plan, verify_global_md_reuse,
)
from megatron_async.writer.commit import unmark_before_rewrite
from megatron_async.buckets.layout import PreparedWrite
from megatron_async.writer.filesystem import FileSystemWriterAsync

__all__ = ["PlanResult", "plan_save", "save_state_dict_async_plan", "plan_with_cache", "make_dist_wrapper"]

logger = logging.getLogger(__name__)

CachedStructure = Tuple[Optional[SavePlan], Optional[SavePlan], bool]

def make_dist_wrapper(process_group: Optional[dist.ProcessGroup], coordinator_rank: int) -> _DistWrapper:
    """The planning group of a save: ``process_group``, else the gloo coordination group."""
    if not coordination.is_distributed():
        return _DistWrapper(None, False, coordinator_rank)
    group = process_group if process_group is not None else coordination.get_coordination_group()
    return _DistWrapper(group, True, coordinator_rank)


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """The outcome of planning one save (every rank).

    Attributes:
        writer: the storage writer, with its buckets prepared.
        metadata: the global metadata on the coordinator when it was built (None
            elsewhere, and when cached plans or a loaded checkpoint's metadata were
            reused: :func:`plan_with_cache` fills in the cached one).
        dist_wrapper: the planning group, for :func:`save_state_dict_async_finalize`.
        central_plan: this rank's final plan.
        local_plan: this rank's local plan.
        reused_cached_plans: no rank's plan differed from the cached one.
        reused_loaded_metadata: the loaded checkpoint's plans fit every rank.
        prepared_write: what the writer made of the final plan (buckets, layout, staging
            key), or None from a writer that does not report it.
    """

    writer: FileSystemWriterAsync
    metadata: Optional[Metadata]
    dist_wrapper: _DistWrapper
    central_plan: SavePlan
    local_plan: SavePlan
    reused_cached_plans: bool
    reused_loaded_metadata: bool
    prepared_write: Optional[PreparedWrite]

    @property
    def finalize_args(self) -> Tuple[FileSystemWriterAsync, Optional[Metadata], _DistWrapper]:
        """``(writer, metadata, dist_wrapper)``: the arguments of the save's finalization."""
        return self.writer, self.metadata, self.dist_wrapper


def plan_save(
    state_dict: STATE_DICT_TYPE,
    storage_writer: FileSystemWriterAsync,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    planner: Optional[SavePlanner] = None,
    cached_ckpt_structure: Optional[CachedStructure] = None,
    loaded_all_plans: Optional[List[Union[bytes, SavePlan]]] = None,
    unmark: bool = True,
) -> PlanResult:
    """Plan a save and prepare the writer's buckets (every rank, synchronous).

    Planning is, from cheapest to most expensive:

    * *cached*: ``cached_ckpt_structure`` holds the previous save's plans and no rank's
      fresh local plan differs from its cached one: no plan is gathered and the returned
      metadata is None (the caller reuses the metadata it cached);
    * *decentralized* (planner and writer both allow it, and the planner's global
      planning is DCP's own, which it replaces): local plans are gathered on the
      coordinator only to build the metadata, and each rank derives its final plan
      itself. The gather is skipped too when ``loaded_all_plans`` (the plan digests of a
      loaded checkpoint's metadata) match every rank's plan;
    * *central*: DCP's gather, global plan, scatter.

    Args:
        state_dict: the state dict to save (PyTorch DCP compatible).
        storage_writer: the writer of this save.
        process_group: group to plan in; defaults to the gloo coordination group.
        coordinator_rank: rank (in that group) that builds and writes the metadata.
        planner: the save planner; defaults to DCP's ``DefaultSavePlanner``.
        cached_ckpt_structure: ``(central_plan, local_plan, validated_cache_reuse)``
            from the previous call. With ``validated_cache_reuse`` the caller vouches that
            this rank's structure is unchanged and the cached local plan is used, as in
            megatron-core; unlike there, the one small all-reduce stays, so ranks that
            disagree plan afresh together instead of waiting on each other. Without it,
            reuse is verified against a fresh local plan.
        loaded_all_plans: the plan digests stored in a loaded checkpoint's metadata (or
            the reference API's whole ``all_local_plans``, compared item by item).
        unmark: remove a complete checkpoint's markers once planned, best effort (the
            reference API); our strategy does it itself, agreed.

    Raises:
        CheckpointValidationError: on every rank, when planning failed on any rank
            (for example overlapping or missing shards).
    """
    dist_wrapper = make_dist_wrapper(process_group, coordinator_rank)
    group = dist_wrapper.group
    planner = planner if planner is not None else DefaultSavePlanner()
    cached_central, cached_local, validated = cached_ckpt_structure or (None, None, False)
    vouched = bool(validated) and cached_central is not None and cached_local is not None

    def local_step() -> SavePlan:
        SaveDirectories.of_process().refuse_if_stuck()  # a step left behind may land late
        planner.set_up_planner(state_dict, is_coordinator=dist_wrapper.is_coordinator)
        storage_writer.set_up_storage_writer(dist_wrapper.is_coordinator, rank=dist_wrapper.rank)
        fresh_plan = cached_local if vouched else planner.create_local_plan()
        # Inside the agreed step: it cannot fail alone on one rank. Fewer objects to pickle
        # in the gathers and the first .metadata; the items become the results' indexes.
        return share_equal_sizes(storage_writer.prepare_local_plan(fresh_plan))

    def plan_changed(local_plan: Optional[SavePlan]) -> List[int]:
        unchanged = (
            local_plan is not None
            and cached_central is not None
            and (vouched or same_plan(local_plan, cached_local))
        )
        return [int(not unchanged)]

    local_plan, (changed,) = agreed_step("local save planning", local_step, group, plan_changed)
    global_metadata: Optional[Metadata] = None
    reused_loaded = False
    if not changed:
        logger.debug("rank %d: checkpoint structure unchanged; reusing cached plans", dist_wrapper.rank)
        central_plan = cached_central
    elif (
        getattr(planner, "can_run_decentralized_global_plan", False)
        and getattr(storage_writer, "can_run_decentralized_global_plan", False)
        and plans_globally_like_dcp(planner)
    ):
        reused_loaded = verify_global_md_reuse(
            loaded_all_plans, local_plan, dist_wrapper.rank, dist_wrapper
        )
        if not reused_loaded:
            global_metadata = _gather_and_build_metadata(planner, local_plan, dist_wrapper)
        central_plan, _ = agreed_step(
            "decentralized save planning",
            lambda: storage_writer.prepare_decentralized_global_plan(
                planner.create_decentralized_global_plan(local_plan)
            ),
            group,
        )
    else:
        central_plan, global_metadata = _plan_centrally(planner, storage_writer, local_plan, dist_wrapper)

    def prepare_step() -> Tuple[SavePlan, Any]:
        final_plan = planner.finish_plan(central_plan)
        return final_plan, storage_writer.prepare_write_data(final_plan, planner)

    (central_plan, prepared), _ = agreed_step("preparing the write", prepare_step, group)
    checkpoint_dir = getattr(storage_writer, "checkpoint_dir", None)
    if unmark and dist_wrapper.is_coordinator and checkpoint_dir is not None:  # planned everywhere
        unmark_before_rewrite(checkpoint_dir)
    return PlanResult(
        writer=storage_writer,
        metadata=global_metadata,
        dist_wrapper=dist_wrapper,
        central_plan=central_plan,
        local_plan=local_plan,
        reused_cached_plans=not changed,
        reused_loaded_metadata=reused_loaded,
        prepared_write=prepared if isinstance(prepared, PreparedWrite) else None,
    )


def save_state_dict_async_plan(
    state_dict: STATE_DICT_TYPE,
    storage_writer: FileSystemWriterAsync,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    planner: Optional[SavePlanner] = None,
    cached_ckpt_structure: Optional[CachedStructure] = None,
    loaded_all_plans: Optional[List[Union[bytes, SavePlan]]] = None,
):
    """Plan a save and prepare the writer's buckets (every rank, synchronous), in
    megatron-core's convention (see :func:`plan_save` for the arguments and how plans
    are reused; nvidia-resiliency-ext's is :mod:`megatron_async.nvrx.state_dict_saver`'s).

    Returns:
        ``((writer, metadata or None, dist_wrapper), central_plan, local_plan,
        reused_cached_plans, reused_loaded_metadata)``: pass the first element to
        :func:`save_state_dict_async_finalize` and the next two as the next call's
        ``cached_ckpt_structure``.

    Raises:
        CheckpointValidationError: on every rank, when planning failed on any rank
            (for example overlapping or missing shards).
    """
    result = plan_save(
        state_dict, storage_writer, process_group, coordinator_rank, planner,
        cached_ckpt_structure, loaded_all_plans,
    )
    return (
        result.finalize_args,
        result.central_plan,
        result.local_plan,
        result.reused_cached_plans,
        result.reused_loaded_metadata,
    )


def plan_with_cache(
    cache: CheckpointMetadataCache,
    state_dict: STATE_DICT_TYPE,
    storage_writer: FileSystemWriterAsync,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    planner: Optional[SavePlanner] = None,
    *,
    vouched: bool,
    unmark: bool = True,
) -> PlanResult:
    """Plan a save offering ``cache``'s plans and metadata for reuse, and record this
    save's in it (every rank, synchronous; see :func:`plan_save`).

    Args:
        cache: the saver's cache; updated on every rank.
        vouched: the caller vouches that this rank's structure is unchanged since the
            cached plans (``validated_cache_reuse`` of ``cached_ckpt_structure``).
        unmark: as :func:`plan_save`'s.

    Returns:
        The result, whose ``metadata`` is the coordinator's for this save: built, or the
        cached one when it was reused (None on the other ranks).
    """
    offered = None
    if cache.can_offer_cached_plans(make_dist_wrapper(process_group, coordinator_rank).is_coordinator):
        offered = (cache.cached_central_plan, cache.cached_local_plan, vouched)
    result = plan_save(
        state_dict, storage_writer, process_group, coordinator_rank, planner,
        cached_ckpt_structure=offered,
        loaded_all_plans=cache.loaded_all_plans,
        unmark=unmark,
    )
    cache.validated_cache_reuse = result.reused_cached_plans
    cache.validated_loaded_metadata_reuse = result.reused_loaded_metadata
    cache.cached_central_plan, cache.cached_local_plan = result.central_plan, result.local_plan
    _, metadata, _ = cache.prepare_save_state_dict_ret(
        result.dist_wrapper.rank, coordinator_rank, result.finalize_args
    )
    return dataclasses.replace(result, metadata=metadata)


def _gather_and_build_metadata(
    planner: SavePlanner, local_plan: SavePlan, dist_wrapper: _DistWrapper
) -> Optional[Metadata]:
    """Gather local plans (and their digests) on the coordinator and build the global metadata there."""
    # Each rank digests its own plan (in parallel) for the metadata's resume record.
    shipped = (local_plan, plan_digest(local_plan))
    gathered = coordination.gather_on_coordinator(shipped, dist_wrapper, "plan")
    metadata, _ = agreed_step(
        "global save planning",
        lambda: (
            build_global_metadata(planner, [p for p, _ in gathered], [d for _, d in gathered])
            if dist_wrapper.is_coordinator
            else None
        ),
        dist_wrapper.group,
    )
    return metadata


def _plan_centrally(
    planner: SavePlanner,
    storage_writer: FileSystemWriterAsync,
    local_plan: SavePlan,
    dist_wrapper: _DistWrapper,
) -> Tuple[SavePlan, Optional[Metadata]]:
    """DCP's central planning: gather local plans, build the global plan, scatter it."""
    built: List[Metadata] = []

    def global_step(all_local_plans: List[SavePlan]) -> List[SavePlan]:
        # Deduplicated by DCP; one rank writes each empty chunk, and never in place of data.
        global_plans, metadata = planner.create_global_plan(
            without_redundant_empty_chunks(all_local_plans)
        )
        built.append(metadata)
        return storage_writer.prepare_global_plan(global_plans)

    coordination.count_gather("plan")
    try:
        with paused_gc():  # the coordinator unpickles and plans every rank's items
            central_plan = dist_wrapper.reduce_scatter("plan", lambda: local_plan, global_step)
    except CheckpointException as exc:  # raised identically on every rank by DCP
        raise CheckpointValidationError(f"global save planning failed: {exc}") from exc
    return central_plan, (built[0] if built else None)
