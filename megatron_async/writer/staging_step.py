"""The staging step in front of one save's write path (trainer, every rank).

:meth:`~megatron_async.writer.filesystem.FileSystemWriterAsync.get_save_function_and_args`
binds the write path (the background writer's ``save_fn``); :func:`with_staging_step`
chooses how the data reaches it, once per save, in the trainer:

* plain staging (:func:`~megatron_async.staging.buffers.preload_tensors`);
* or, with ``overlap_staging``, the copy on a trainer thread after scheduling
  (:mod:`megatron_async.staging.overlapped`);

and wraps either in the staging memory budget
(:func:`~megatron_async.staging.budget.budgeted_preload`): rounds when the state is larger
than the budget, a wait for an earlier save's memory instead of a second copy.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, List, Optional, Tuple

from megatron_async.core import coordination
from megatron_async.staging.budget import budgeted_preload
from megatron_async.staging.buffers import StagingBufferCache
from megatron_async.staging.overlapped import overlapped_save_functions
from megatron_async.staging.gate import StagingGate
from megatron_async.buckets.layout import ResolvedPlanData, WriteBucket
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
        ``save_fn`` (wrapped for overlapped staging), the budgeted ``preload_fn``, and
        ``args`` (``[rank, None, results_queue]``; the caller puts the staged buckets
        in ``args[1]``).
    """
    rounds = "staging_control" in save_fn.keywords
    if overlap_staging:  # above the budget: rounds copied by the copy thread
        save_fn, preload_fn, args, overlapped = overlapped_save_functions(
            save_fn, resolved_plan_data, staging_cache, results_queue, gate
        )
    else:
        preload_fn = bind_supported(
            preload_tensors, (resolved_plan_data, True), staging_cache=staging_cache
        )
        args, overlapped = [coordination.get_rank(), None, results_queue], None
    preload_fn = budgeted_preload(
        gate, preload_fn, write_buckets, memory_limit,
        staging_cache, overlapped, stats, rounds=rounds,
    )
    return save_fn, preload_fn, args
