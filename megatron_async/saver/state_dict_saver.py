"""Plan and finalize an asynchronous PyTorch DCP save, with every collective on gloo.

``torch.distributed.checkpoint.save`` plans, writes and commits in one call. An
asynchronous save splits it:

1. :func:`save_state_dict_async_plan` (every rank, synchronous): plan, and prepare the
   writer's buckets;
2. the writer's save function (background): write the data;
3. :func:`save_state_dict_async_finalize` (every rank, once the background part is done
   everywhere): gather the write results; the coordinator writes ``.metadata`` only if
   no rank failed; a failure anywhere raises on every rank.

Planning gathers every rank's local plan on the coordinator, which builds the global
metadata. When the structure of the checkpoint does not change from save to save (the
usual case in training), that gather is skipped: each rank compares its fresh local plan
with the cached one and one small all-reduce tells whether any rank's plan changed. If
none did, the cached plans and metadata are reused; if any did, the ranks plan from
scratch, so a changed structure never produces a wrong checkpoint.

A caller that can tell cheaply that its structure is unchanged (the megatron-core
strategy compares a fingerprint of the sharded state dict) skips even the local plan:
it agrees on that with every rank itself and calls :func:`prepare_cached_write` with the
cached plan and the items resolved to the new data.

All collectives run on the library's gloo coordination group, never on CUDA tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron_async.saver.agreement import agree_or_raise
from megatron_async.saver.metadata_cache import CheckpointMetadataCache, default_metadata_cache
from megatron_async.writer.buckets import BucketLayout, is_empty_chunk
from megatron_async.core import coordination
from megatron_async.errors import CheckpointValidationError, RankFailure
from megatron_async.writer.filesystem import FileSystemWriterAsync

__all__ = [
    "CheckpointMetadataCache",
    "save_state_dict_async_plan",
    "prepare_cached_write",
    "verify_global_md_reuse",
    "build_global_metadata",
    "save_state_dict_async_finalize",
    "get_plan_gather_count",
]

logger = logging.getLogger(__name__)

CachedStructure = Tuple[Optional[SavePlan], Optional[SavePlan], bool]
PlanResult = Tuple[
    Tuple[FileSystemWriterAsync, Optional[Metadata], _DistWrapper], SavePlan, SavePlan, bool, bool
]

_gather_lock = threading.Lock()
_plan_gather_count = 0


def get_plan_gather_count() -> int:
    """How many times this process took part in gathering local plans (a cached save adds 0)."""
    return _plan_gather_count


def _count_plan_gather() -> None:
    global _plan_gather_count
    with _gather_lock:
        _plan_gather_count += 1


def _same_plan(plan: SavePlan, other: Optional[SavePlan]) -> bool:
    """Compare two local plans on everything but the storage data."""
    if other is None:
        return False
    return all(
        getattr(plan, f.name) == getattr(other, f.name)
        for f in dataclasses.fields(plan)
        if f.name != "storage_data"
    )


def _make_dist_wrapper(process_group: Optional[dist.ProcessGroup], coordinator_rank: int):
    if not coordination.is_distributed():
        return _DistWrapper(None, False, coordinator_rank)
    group = process_group if process_group is not None else coordination.get_coordination_group()
    return _DistWrapper(group, True, coordinator_rank)


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

    Two calling conventions share this function:

    * megatron-core's (``cached_ckpt_structure`` / ``loaded_all_plans``): returns the
      five-element :data:`PlanResult` described below;
    * nvidia-resiliency-ext's, chosen by passing ``enable_cache`` or ``metadata_cache``:
      the cached plans live in a :class:`CheckpointMetadataCache` (the process-wide one
      when ``enable_cache=True`` comes without one) and the result is only
      ``(writer, metadata, dist_wrapper)``, with the cached metadata filled in on the
      coordinator. With ``enable_cache=False`` the cache is neither read nor updated.

    Planning is, from cheapest to most expensive:

    * *cached*: ``cached_ckpt_structure`` holds the previous save's plans and no rank's
      fresh local plan differs from its cached one: no plan is gathered and the returned
      metadata is None (the caller reuses the metadata it cached);
    * *decentralized* (planner and writer both allow it): local plans are gathered on the
      coordinator only to build the metadata, and each rank derives its final plan
      itself. The gather is skipped too when ``loaded_all_plans`` (the ``all_local_plans``
      of a loaded checkpoint's metadata) match every rank's plan;
    * *central*: DCP's gather, global plan, scatter.

    Args:
        state_dict: the state dict to save (PyTorch DCP compatible).
        storage_writer: the writer of this save.
        process_group: group to plan in; defaults to the gloo coordination group.
        coordinator_rank: rank (in that group) that builds and writes the metadata.
        planner: the save planner; defaults to DCP's ``DefaultSavePlanner``.
        cached_ckpt_structure: ``(central_plan, local_plan, validated_cache_reuse)``
            from the previous call. With ``validated_cache_reuse`` the caller vouches that
            this rank's structure is unchanged: the local plan is not computed again (the
            cached one is used), as in megatron-core. Unlike megatron-core, the one small
            all-reduce stays, so ranks that disagree plan afresh together instead of
            waiting on each other. Without it, reuse is verified against a fresh local plan.
        loaded_all_plans: local plans stored in a loaded checkpoint's metadata.

    Returns:
        ``((writer, metadata or None, dist_wrapper), central_plan, local_plan,
        reused_cached_plans, reused_loaded_metadata)``; pass the first element to
        :func:`save_state_dict_async_finalize` and the next two as the next call's
        ``cached_ckpt_structure``.

    Raises:
        CheckpointValidationError: on every rank, when planning failed on any rank
            (for example overlapping or missing shards).
    """
    if enable_cache is not None or metadata_cache is not None:
        return _plan_with_metadata_cache(
            state_dict, storage_writer, process_group, coordinator_rank, planner,
            bool(enable_cache), metadata_cache,
        )
    dist_wrapper = _make_dist_wrapper(process_group, coordinator_rank)
    group = dist_wrapper.group
    planner = planner if planner is not None else DefaultSavePlanner()
    cached_central, cached_local, validated = cached_ckpt_structure or (None, None, False)
    # The caller vouches that nothing changed: skip the local planning, as megatron-core does.
    vouched = bool(validated) and cached_central is not None and cached_local is not None

    local_plan: Optional[SavePlan] = None
    local_error: Optional[BaseException] = None
    try:
        planner.set_up_planner(state_dict, is_coordinator=dist_wrapper.is_coordinator)
        storage_writer.set_up_storage_writer(dist_wrapper.is_coordinator, rank=dist_wrapper.rank)
        fresh_plan = cached_local if vouched else planner.create_local_plan()
        local_plan = storage_writer.prepare_local_plan(fresh_plan)
    except Exception as exc:  # agreed on below, so that no rank is left waiting
        local_error = exc
    unchanged = (
        local_error is None
        and cached_central is not None
        and (vouched or _same_plan(local_plan, cached_local))
    )
    (changed,) = agree_or_raise(local_error, "local save planning", [int(not unchanged)], group)

    global_metadata: Optional[Metadata] = None
    reused_loaded = False
    if not changed:
        logger.debug("rank %d: checkpoint structure unchanged; reusing cached plans", dist_wrapper.rank)
        central_plan = cached_central
    elif getattr(planner, "can_run_decentralized_global_plan", False) and getattr(
        storage_writer, "can_run_decentralized_global_plan", False
    ):
        reused_loaded = verify_global_md_reuse(
            loaded_all_plans, local_plan, dist_wrapper.rank, dist_wrapper
        )
        if not reused_loaded:
            global_metadata = _gather_and_build_metadata(planner, local_plan, dist_wrapper)
        central_plan, plan_error = None, None
        try:
            central_plan = storage_writer.prepare_decentralized_global_plan(
                planner.create_decentralized_global_plan(local_plan)
            )
        except Exception as exc:  # agreed on below, so that no rank is left waiting
            plan_error = exc
        agree_or_raise(plan_error, "decentralized save planning", (), group)
    else:
        central_plan, global_metadata = _plan_centrally(planner, storage_writer, local_plan, dist_wrapper)

    prepare_error: Optional[BaseException] = None
    try:
        central_plan = planner.finish_plan(central_plan)
        storage_writer.prepare_write_data(central_plan, planner)
    except Exception as exc:
        prepare_error = exc
    agree_or_raise(prepare_error, "preparing the write", (), group)
    return (
        (storage_writer, global_metadata, dist_wrapper),
        central_plan,
        local_plan,
        not changed,
        reused_loaded,
    )


def _plan_with_metadata_cache(
    state_dict: STATE_DICT_TYPE,
    storage_writer: FileSystemWriterAsync,
    process_group: Optional[dist.ProcessGroup],
    coordinator_rank: int,
    planner: Optional[SavePlanner],
    enable_cache: bool,
    metadata_cache: Optional[CheckpointMetadataCache],
) -> Tuple[FileSystemWriterAsync, Optional[Metadata], _DistWrapper]:
    """Plan through a :class:`CheckpointMetadataCache` (every rank, nvidia-resiliency-ext style)."""
    if not enable_cache:
        prepared, *_ = save_state_dict_async_plan(
            state_dict, storage_writer, process_group, coordinator_rank, planner
        )
        return prepared
    cache = metadata_cache if metadata_cache is not None else default_metadata_cache()
    if process_group is not None and coordination.is_distributed():
        rank = dist.get_rank(process_group)
    else:
        rank = coordination.get_rank()
    cached_structure = None
    if cache.can_offer_cached_plans(rank == coordinator_rank):
        cached_structure = (cache.cached_central_plan, cache.cached_local_plan, True)
    (writer, metadata, dist_wrapper), central_plan, local_plan, reused, reused_loaded = (
        save_state_dict_async_plan(
            state_dict,
            storage_writer,
            process_group,
            coordinator_rank,
            planner,
            cached_ckpt_structure=cached_structure,
            loaded_all_plans=cache.loaded_all_plans,
        )
    )
    metadata = cache.record_plan(central_plan, local_plan, metadata, reused, reused_loaded)
    return writer, metadata, dist_wrapper


def prepare_cached_write(
    storage_writer: FileSystemWriterAsync,
    central_plan: SavePlan,
    resolved: Sequence[Tuple[WriteItem, Any]],
    layout: Optional[BucketLayout] = None,
    staging_key: Optional[str] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
) -> Tuple[FileSystemWriterAsync, _DistWrapper]:
    """Prepare the writer of a save that reuses the previous save's plan (every rank, local).

    Runs no collective. The caller must have established, with every rank, that no
    rank's structure changed since the save that produced ``central_plan`` (one
    all-reduce) before it schedules the write, and reuses that save's metadata.

    Args:
        storage_writer: the writer of this save.
        central_plan: this rank's final plan of the previous save.
        resolved: ``(write_item, data)`` for every item of ``central_plan``, in plan
            order, with this save's data.
        layout: the previous save's bucket layout (computed when None).
        staging_key: the previous save's staging key (computed when None).
        process_group: group the plan was made in; defaults to the coordination group.
        coordinator_rank: rank (in that group) that writes the metadata.

    Returns:
        ``(writer, dist_wrapper)``, for :func:`save_state_dict_async_finalize`.
    """
    dist_wrapper = _make_dist_wrapper(process_group, coordinator_rank)
    storage_writer.set_up_storage_writer(dist_wrapper.is_coordinator, rank=dist_wrapper.rank)
    storage_writer.prepare_resolved_write_data(central_plan, resolved, layout, staging_key)
    return storage_writer, dist_wrapper


def _gather_and_build_metadata(
    planner: SavePlanner, local_plan: SavePlan, dist_wrapper: _DistWrapper
) -> Optional[Metadata]:
    """Gather local plans on the coordinator and build the global metadata there."""
    _count_plan_gather()
    all_local_plans = dist_wrapper.gather_object(local_plan)
    metadata, error = None, None
    if dist_wrapper.is_coordinator:
        try:
            metadata = build_global_metadata(planner, all_local_plans)
        except Exception as exc:  # e.g. overlapping shards; raised on every rank below
            error = exc
    agree_or_raise(error, "global save planning", (), dist_wrapper.group)
    return metadata


def build_global_metadata(planner: SavePlanner, all_local_plans: List[SavePlan]) -> Metadata:
    """Build the global metadata of a decentralized save from every rank's local plan.

    Runs on the coordinator. With decentralized planning every rank writes its own local
    plan as it is, so no item may be planned by two ranks; the one exception is a tensor
    chunk without elements, which several ranks may hold at the same offset (uneven
    splits). The metadata lists each ``(fqn, offset)`` once, as megatron-core's does: an
    empty chunk at the offset of a chunk with data is left out, and of several empty
    chunks at one offset only one zero-size chunk is listed.

    Args:
        planner: the save planner (it validates the global plan: bounds, overlaps, fill).
        all_local_plans: every rank's local plan, in rank order.

    Returns:
        The metadata, with ``all_local_plans`` (unchanged) attached, so that a resumed job
        can skip the plan gather.

    Raises:
        CheckpointValidationError: overlapping or missing shards, or another invalid plan.
    """
    _raise_on_duplicate_items(all_local_plans)
    try:
        _, metadata = planner.create_global_plan(_without_redundant_empty_chunks(all_local_plans))
    except ValueError as exc:  # DCP's validation: overlapping, out-of-bounds or missing chunks
        raise CheckpointValidationError(f"invalid global save plan: {exc}") from exc
    # Stored in .metadata so that a resumed job can skip this gather.
    metadata.all_local_plans = all_local_plans
    return metadata


def _raise_on_duplicate_items(all_local_plans: Sequence[SavePlan]) -> None:
    """Refuse items that several ranks would write (decentralized plans are not deduplicated).

    DCP's global planning silently deduplicates identical chunks, but with decentralized
    planning every rank writes its own plan, so which copy the metadata points to would
    depend on the order of the results. Chunks without elements are exempt: they overlap
    nothing, and the commit points the metadata at one of them.
    """
    owners: dict = {}
    for rank, plan in enumerate(all_local_plans):
        for item in plan.items:
            if not is_empty_chunk(item):
                owners.setdefault(item.index, []).append(rank)
    duplicates = [(index, ranks) for index, ranks in owners.items() if len(ranks) > 1]
    if duplicates:
        shown = "; ".join(
            f"{index.fqn} at offset {tuple(index.offset or ())} on ranks {ranks}"
            for index, ranks in duplicates[:5]
        )
        raise CheckpointValidationError(
            f"{len(duplicates)} item(s) are saved by more than one rank (overlapping shards): "
            f"{shown}. Exactly one rank must hold each shard with replica_id 0."
        )


def _without_redundant_empty_chunks(all_local_plans: List[SavePlan]) -> List[SavePlan]:
    """Leave out the empty chunks that another item already describes (coordinator).

    ``MetadataIndex`` equality ignores the index hint, so the metadata (and DCP's
    deduplication) treat items at the same ``(fqn, offset)`` as one. Left to DCP, which
    copy survives depends on plan sizes, and an empty chunk could replace a chunk with
    data at its offset (a "missing shard" error). Here the chunk with data is kept, else
    the lowest rank's empty chunk; the plans are returned unchanged when nothing is left
    out.
    """
    empty = [item for plan in all_local_plans for item in plan.items if is_empty_chunk(item)]
    if not empty:
        return all_local_plans
    described = {
        item.index for plan in all_local_plans for item in plan.items if not is_empty_chunk(item)
    }
    left_out = set()
    for item in empty:  # in rank order
        if item.index in described:
            left_out.add(id(item))
        else:
            described.add(item.index)
    if not left_out:
        return all_local_plans
    return [
        dataclasses.replace(plan, items=[item for item in plan.items if id(item) not in left_out])
        for plan in all_local_plans
    ]


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
            _without_redundant_empty_chunks(all_local_plans)
        )
        built.append(metadata)
        return storage_writer.prepare_global_plan(global_plans)

    _count_plan_gather()
    try:
        central_plan = dist_wrapper.reduce_scatter("plan", lambda: local_plan, global_step)
    except CheckpointException as exc:  # raised identically on every rank by DCP
        raise CheckpointValidationError(f"global save planning failed: {exc}") from exc
    return central_plan, (built[0] if built else None)


def verify_global_md_reuse(
    loaded_all_plans: Optional[Sequence[SavePlan]],
    local_plan: SavePlan,
    rank: int,
    dist_wrapper: _DistWrapper,
) -> bool:
    """Tell whether a loaded checkpoint's metadata fits this save on every rank.

    Runs on every rank and always costs one all-reduce (so that ranks with and without
    loaded plans stay in step). A rank agrees when the loaded plans are from a job of
    the same size and its own entry equals ``local_plan`` apart from the storage data.

    Args:
        loaded_all_plans: ``all_local_plans`` of the loaded metadata, or None.
        local_plan: this rank's fresh local plan.
        rank: this rank's index in the planning group.
        dist_wrapper: the planning wrapper.

    Returns:
        True on every rank if every rank agrees, else False on every rank.
    """
    try:
        local_ok = (
            bool(loaded_all_plans)
            and len(loaded_all_plans) == dist_wrapper.get_world_size()
            and _same_plan(local_plan, loaded_all_plans[rank])
        )
    except Exception as exc:  # an unexpected plan layout: plan afresh rather than diverge
        logger.debug("rank %d: cannot compare with the loaded plans: %s", rank, exc)
        local_ok = False
    if not local_ok and loaded_all_plans:
        logger.debug("rank %d: loaded checkpoint plans differ from this save's plan", rank)
    (any_mismatch,) = coordination.all_reduce_max([int(not local_ok)], dist_wrapper.group)
    return not any_mismatch


def _is_wrapped_exception(results: Any) -> bool:
    """Whether ``results`` is DCP's ``(exception, traceback)`` instead of write results."""
    return isinstance(results, tuple) and len(results) == 2 and isinstance(results[0], BaseException)


def save_state_dict_async_finalize(
    storage_writer: FileSystemWriterAsync,
    global_metadata: Optional[Metadata],
    dist_wrapper: _DistWrapper,
) -> None:
    """Commit the save once the background write is done on every rank (every rank).

    Every rank reports whether its write succeeded; only if all did does the coordinator
    gather the write results and write ``.metadata`` (atomically). Costs two all-reduces
    and one gather on the coordination group.

    Raises:
        AsyncSaveFailedError: on every rank, when the write failed on any rank or the
            coordinator could not write the metadata. No ``.metadata`` is written then.
    """
    checkpoint = str(storage_writer.checkpoint_id)
    group = dist_wrapper.group
    rank = coordination.get_rank()
    results: List[Any] = []
    failure: Optional[RankFailure] = None
    try:
        results = storage_writer.retrieve_write_results()
        if _is_wrapped_exception(results):  # the reference API returns background failures
            raise results[0]
    except Exception as exc:  # reported on every rank below
        logger.error("rank %d: background write of %s failed: %s", rank, checkpoint, exc)
        failure = getattr(exc, "failure", None) or RankFailure.from_exception(rank, "write", exc)
        results = []
    coordination.raise_if_any_rank_failed(failure, group, checkpoint)

    start = time.monotonic()
    all_results = dist_wrapper.gather_object(results)
    logger.debug("rank %d: gathered the write results of %s in %.3fs", rank, checkpoint, time.monotonic() - start)
    if dist_wrapper.is_coordinator:
        try:
            if global_metadata is None:
                raise CheckpointValidationError(
                    f"the coordinator has no metadata for {checkpoint}; the plan cache was lost"
                )
            start = time.monotonic()
            storage_writer.finish(global_metadata, all_results)
            logger.debug(
                "rank %d: wrote the metadata of %s in %.3fs", rank, checkpoint, time.monotonic() - start
            )
        except Exception as exc:
            logger.error("rank %d: writing the metadata of %s failed: %s", rank, checkpoint, exc)
            failure = RankFailure.from_exception(rank, "finalize", exc)
    coordination.raise_if_any_rank_failed(failure, group, checkpoint)
