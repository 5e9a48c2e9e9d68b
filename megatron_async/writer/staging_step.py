"""The staging step in front of one save's write path (trainer, every rank).

:meth:`~megatron_async.writer.filesystem.FileSystemWriterAsync.get_save_function_and_args`
binds the write path (the background writer's ``save_fn``); :func:`with_staging_step`
puts the save's stager (:class:`~megatron_async.staging.stager.BucketStager`: within the
staging memory budget, in one round or in rounds, copied now or, with
``overlap_staging``, on the copy thread after scheduling) in front of it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, List, Optional, Tuple

from megatron_async.buckets.layout import ResolvedPlanData, WriteBucket, unpack_resolved_plan_data
from megatron_async.core import coordination
from megatron_async.staging.buffer_cache import StagingBufferCache
from megatron_async.staging.gate import DEFAULT_STAGING_WAIT_S, StagingGate, write_after_staging
from megatron_async.staging.stager import BucketStager
from megatron_async.writer.write_paths import bind_supported

__all__ = ["with_staging_step"]


def with_staging_step(
    save_fn: "partial[Any]",
    preload_tensors: Callable[..., Any],
    *,
    gate: StagingGate,
    write_buckets: List[WriteBucket],
    resolved_plan_data: ResolvedPlanData,
    results_queue: Any,
    overlap_staging: bool,
    memory_limit: Any,
    staging_cache: Optional[StagingBufferCache],
    stats: dict,
) -> Tuple[Callable[..., None], Callable[[], Any], List[Any]]:
    """Return ``(save_fn, preload_fn, args)`` of a save whose write path is ``save_fn``.

    Runs in the trainer, once per save with something to write.

    Args:
        save_fn: the bound write path; it takes the items in rounds if it accepts
            ``staging_control`` (an override with the reference signature does not, and
            a state above the budget is then refused).
        preload_tensors: the writer's staging function (a subclass may override it).
        gate: the save's gate between stager and writer (:mod:`megatron_async.staging.gate`),
            also bound to ``save_fn`` (``staging_control``).
        write_buckets: the save's buckets.
        resolved_plan_data: what ``preload_tensors`` stages.
        results_queue: where the background writer reports.
        overlap_staging: the writer's ``overlap_staging`` (the copy on a trainer thread).
        memory_limit: the writer's ``staging_memory_limit`` (the budget).
        staging_cache: the trainer's reusable staging buffers.
        stats: filled by staging with ``rounds`` and ``peak_bytes``.

    Returns:
        ``save_fn`` (wrapped for overlapped staging), the stager's ``stage``, and
        ``args`` (``[rank, None, results_queue]``; the caller puts the staged buckets
        in ``args[1]``).
    """
    identifier, _ = unpack_resolved_plan_data(resolved_plan_data)
    stager = BucketStager(
        gate, write_buckets, limit=memory_limit, overlapped=overlap_staging,
        cache=staging_cache, cache_key=identifier.key if identifier is not None else None,
        stage_one_go=bind_supported(
            preload_tensors, (resolved_plan_data, True), staging_cache=staging_cache
        ),
        rounds_allowed="staging_control" in save_fn.keywords, stats=stats,
    )
    if overlap_staging:  # the writer waits for the copy thread before it writes a byte
        save_fn = partial(write_after_staging, gate, DEFAULT_STAGING_WAIT_S, save_fn)
    return save_fn, stager.stage, [coordination.get_rank(), None, results_queue]
