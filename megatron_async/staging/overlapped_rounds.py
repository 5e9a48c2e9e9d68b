"""Overlapped staging of a state larger than the staging budget: every round off the
training thread.

With ``overlap_staging`` and a ``staging_memory_limit`` below a rank's state, the state
goes through the budget's pool in rounds, with :mod:`.rounds`' ring plan, the save's
gate and the writer view, but scheduling copies nothing:

1. scheduling (the request's ``preload_fn``, trainer) leases the pool, gives every item
   its place in it and records each saved tensor's version counter; it marks the save's
   :class:`~.gate.StagingGate` staged at once, since the writer waits on it for each item
   instead;
2. once the request is with its background writer, the overlapped copy thread (the one
   :func:`~.overlapped.wait_for_staging` waits for) runs the same
   :class:`~.copy_job.CopyJob` as overlapped staging in one go, in rounds: it copies
   the items in the writer's order, each once the writer marked the items whose bytes
   it overwrites *written*. CUDA sources are copied on the save's side stream into the
   page-locked pool, and synchronized before they are marked copied;
3. the next optimizer step (the global step pre-hook) waits until the last round is
   copied: under a budget, the trainer's wait for the drain moves there.

Every wait of the copy thread is bounded on its own (``timeout_s`` without the writer
freeing anything) and ends early when the writer is done (it failed: nothing more will be
read), when either side recorded a failure, or when the writer's process is gone (the
caller records it at the hand-over), so neither the copy thread nor the optimizer step
outlives a dead writer by more than a poll; the optimizer step's wait goes on while the
copy progresses. A saved
tensor whose version counter moved before its copy finished fails the save on every
rank (:class:`~megatron_async.errors.StagingRaceError`, raised by the writer as it waits
for that item), as with overlapped staging in one go. The files are byte-identical to a
save staged in one go.

Runs in the trainer.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from megatron_async.staging.buffers import StagedBuckets, StagingBufferCache
from megatron_async.staging.gate import StagingGate
from megatron_async.staging.copy_job import CopyJob
from megatron_async.staging.overlapped import (
    install_optimizer_hook,
    submit_copy,
    overlapped_save_functions,
    wait_for_staging,
)
from megatron_async.staging.rounds import RoundPlan, place_in_pool
from megatron_async.buckets.layout import WriteBucket

__all__ = ["OverlappedRoundsStaged", "stage_in_rounds_overlapped", "overlapped_functions_with_rounds"]

logger = logging.getLogger(__name__)


class OverlappedRoundsStaged(StagedBuckets):
    """Buckets staged in rounds by the overlapped copy thread: views of the pool (trainer).

    ``start_background_copy`` hands the copies to the copy thread once the request is
    with its writer; scheduling does not wait for them (the next optimizer step does).
    Pickled, only the buckets travel.
    """

    def __init__(self, buckets: Sequence[WriteBucket], plan: RoundPlan, job: CopyJob):
        super().__init__(buckets)
        self.plan = plan
        self._job: Optional[CopyJob] = job

    def start_background_copy(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            submit_copy(job)


def stage_in_rounds_overlapped(
    rank: int,
    buckets: Sequence[WriteBucket],
    pool: torch.Tensor,
    budget: int,
    gate: StagingGate,
    timeout_s: float,
) -> OverlappedRoundsStaged:
    """Place ``buckets``' tensors in ``pool`` and prepare their copy without copying
    (trainer, the request's ``preload_fn`` with overlapped staging above the budget).

    Takes the arguments of :func:`~.rounds.stage_in_rounds` after ``rank``, which
    :func:`overlapped_functions_with_rounds` binds.
    An earlier overlapped copy is waited for first: copies run one save at a time.

    Raises:
        StagingMemoryError: a single tensor is larger than ``budget``.
        AsyncTimeoutError: an earlier overlapped copy did not finish within ``timeout_s``.
    """
    wait_for_staging(timeout_s)
    install_optimizer_hook()
    plan, staged, to_copy = place_in_pool(buckets, pool, budget, gate)
    job = CopyJob(gate, [entry[1:] for entry in to_copy], rank,
                  indices=[entry[0] for entry in to_copy], waits_for=plan.waits_for,
                  timeout_s=timeout_s, what="overlapped staging in rounds")
    gate.mark_staged()  # the writer waits on the gate for each item
    logger.debug(
        "rank %d: overlapped staging of %d items in %d rounds through a %d-byte pool",
        rank, len(plan.sizes), plan.rounds, plan.pool_bytes,
    )
    return OverlappedRoundsStaged(staged, plan, job)


def overlapped_functions_with_rounds(
    save_fn: Callable[..., Any],
    resolved_plan_data: Any,
    staging_cache: Optional[StagingBufferCache],
    results_queue: Any,
    gate: StagingGate,
) -> Tuple[Callable[..., Any], Callable[[], StagedBuckets], List[Any], Callable[..., Any]]:
    """Return :func:`~.overlapped.overlapped_save_functions`' ``(save_fn, preload_fn,
    args)`` and the stager the staging budget uses above the budget (trainer).

    The stager is :func:`stage_in_rounds_overlapped` with this rank bound;
    :func:`~megatron_async.staging.budget.stage_within_budget` calls it in place of
    :func:`~.rounds.stage_in_rounds`.
    """
    save_fn, preload_fn, args = overlapped_save_functions(
        save_fn, resolved_plan_data, staging_cache, results_queue, gate
    )
    return save_fn, preload_fn, args, partial(stage_in_rounds_overlapped, args[0])
