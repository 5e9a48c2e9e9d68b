"""Staging in rounds: a save larger than the staging budget goes through a bounded pool.

Runs in the trainer. With a ``staging_memory_limit`` (:mod:`.budget`) smaller than a
rank's state, every tensor item gets a fixed offset in one shared-memory *pool* of at
most the budget, in the order the writer reads them (bucket by bucket, item by item):
one after the other, wrapping to the start when the next item does not fit before the
end (a ring). Each item waits for the earlier items whose bytes it overwrites
(:func:`plan_rounds`).

The pool and the save's gate (:mod:`.gate`) exist before the fork or the send, so no
buffer is handed over later. ``preload_fn`` copies the first round (the items that
overwrite nothing; none with overlapped staging); the copy thread copies the others
after the hand-over (:mod:`.overlapped`), each once the writer marked the items it
overwrites *written*, and scheduling returns once they are copied (with overlapped
staging the next optimizer step waits instead). The files are byte-identical to a save
staged in one go.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Deque, List, Optional, Sequence

import torch

from megatron_async.core import shared_memory
from megatron_async.core.device_wait import wait_for_device_copies
from megatron_async.errors import StagingMemoryError
from megatron_async.staging.buffers import StagedBuckets
from megatron_async.staging.overlapped import OVERLAPPED_ADVICE, CopyJob, watch
from megatron_async.staging.gate import StagingGate
from megatron_async.buckets.layout import WriteBucket

__all__ = [
    "RoundPlan",
    "plan_rounds",
    "plan_bucket_rounds",
    "stage_in_rounds",
    "copy_first_round",
]

logger = logging.getLogger(__name__)

_ADVICE = ("Do not change saved tensors until scheduling returns, or raise "
           "staging_memory_limit")

@dataclasses.dataclass
class RoundPlan:
    """Where every tensor item goes in the pool, and what it waits for.

    Items are numbered in the writer's order: bucket by bucket, each bucket's tensor
    items in order. ``offsets[i]`` is item ``i``'s byte offset in the pool (None for an
    empty tensor), ``waits_for[i]`` the earlier items whose bytes it overwrites;
    ``rounds``: how many times the pool is filled (1: the whole state at once).
    """

    pool_bytes: int
    offsets: List[Optional[int]]
    waits_for: List[List[int]]
    rounds: int


def plan_rounds(sizes: Sequence[int], names: Sequence[str], budget: int) -> RoundPlan:
    """Place items of ``sizes`` bytes in a ring of at most ``budget`` bytes (trainer).

    Raises:
        StagingMemoryError: one item alone is larger than the budget; the message names
            it and the budget it needs.
    """
    offsets: List[Optional[int]] = []
    waits_for: List[List[int]] = []
    # What earlier items still occupy, as [item, start, end] in ring order from the
    # current position: ``ahead`` (placed before this lap) and ``behind`` (this lap).
    ahead: Deque[List[int]] = collections.deque()
    behind: List[List[int]] = []
    position, used, rounds = 0, 0, 1
    for idx, size in enumerate(sizes):
        if size == 0:
            offsets.append(None)
            waits_for.append([])
            continue
        if size > budget:
            raise StagingMemoryError(
                f"tensor {names[idx]!r} alone needs {size} bytes of staging memory, more than "
                f"the staging_memory_limit of {budget} bytes; raise the limit to at least "
                f"{shared_memory.aligned(size)} bytes (--ckpt-staging-memory-limit)"
            )
        start = shared_memory.aligned(position)
        if start + size > budget:
            start, rounds = 0, rounds + 1
            ahead.extendleft(reversed(behind))  # this lap's items are next in the ring
            behind = []
        end = start + size
        waits: List[int] = []
        while ahead and ahead[0][1] < end:
            entry = ahead[0]
            waits.append(entry[0])
            if entry[2] > end:
                entry[1] = end  # partly overwritten: the rest still holds the older item
                break
            ahead.popleft()
        behind.append([idx, start, end])
        offsets.append(start)
        waits_for.append(waits)
        position = end
        used = max(used, end)
    return RoundPlan(used, offsets, waits_for, rounds)


def plan_bucket_rounds(buckets: Sequence[WriteBucket], budget: int) -> RoundPlan:
    """Place every tensor item of ``buckets``, in the writer's order, in a ring of at most
    ``budget`` bytes (trainer, before anything is held or staged).

    Raises:
        StagingMemoryError: one tensor alone is larger than ``budget`` (naming it).
    """
    pairs = [pair for bucket in buckets for pair in bucket.data[1]]
    return plan_rounds(
        [tensor.numel() * tensor.element_size() for _, tensor in pairs],
        [item.index.fqn for item, _ in pairs],
        budget,
    )


def stage_in_rounds(
    buckets: Sequence[WriteBucket],
    pool: torch.Tensor,
    plan: RoundPlan,
    gate: StagingGate,
    timeout_s: float,
    overlapped: bool = False,
) -> StagedBuckets:
    """Give every item of ``buckets`` its place in ``pool`` and copy the first round
    (trainer, ``preload_fn``); the later rounds are the result's ``copy_job``.

    Args:
        buckets: the planned buckets (tensors anywhere).
        pool: a shared-memory segment of at least the plan's bytes (page-locked for CUDA
            sources by its owner).
        plan: the items' places in ``pool`` (:func:`plan_bucket_rounds`).
        gate: the save's gate, one word per tensor item of ``buckets``; marked *in rounds*.
        timeout_s: bound on every wait for the writer.
        overlapped: copy nothing now: every round is the copy thread's, and scheduling
            does not wait for it (the next optimizer step does).
    """
    gate.start_rounds()
    items: List[tuple] = []
    staged = StagedBuckets()
    places = enumerate(plan.offsets)  # gate index and pool offset, in the writer's order
    for bucket in buckets:
        pairs = []
        for (item, tensor), (idx, offset) in zip(bucket.data[1], places):
            source = tensor.detach()
            if offset is None:
                buffer = torch.empty(source.shape, dtype=source.dtype)
            else:
                buffer = shared_memory.segment_view(pool, offset, tuple(source.shape), source.dtype)
                items.append((idx, item.index.fqn, source, buffer, watch(source)))
            pairs.append((item, buffer))
        staged.append(WriteBucket(bucket.file_path, bucket.file_name, (bucket.data[0], pairs)))
    what, advice = (("overlapped staging in rounds", OVERLAPPED_ADVICE) if overlapped
                    else ("staging in rounds", _ADVICE))
    staged.scheduling_waits = not overlapped
    staged.copy_job = copy_first_round(gate, plan, items, pool, overlapped, timeout_s, what, advice)
    return staged


def copy_first_round(
    gate: StagingGate, plan: RoundPlan, items: List[tuple], pool: torch.Tensor,
    overlapped: bool, timeout_s: float, what: str, advice: str,
) -> CopyJob:
    """Copy now the items that overwrite nothing (none when ``overlapped``), mark them and
    the empty items copied, and return the job of the rest (trainer, ``preload_fn``).

    ``items``: ``(gate index, name, source, buffer in pool, watched)`` of every non-empty
    item, in the writer's order; ``what`` and ``advice`` name the mode in messages.
    """
    now = [] if overlapped else [entry for entry in items if not plan.waits_for[entry[0]]]
    for _, _, source, buffer, _ in now:
        buffer.copy_(source, non_blocking=source.device.type == "cuda")
    devices = {entry[2].device for entry in now if entry[2].device.type == "cuda"}
    if devices:
        wait_for_device_copies(devices, holding=pool)
    for idx, offset in enumerate(plan.offsets):
        if offset is None or not (overlapped or plan.waits_for[idx]):
            gate.mark_copied(idx)
    later = [entry for entry in items if overlapped or plan.waits_for[entry[0]]]
    logger.debug(
        "staging %d items in %d rounds through a %d-byte pool (%d copied now)",
        len(plan.offsets), plan.rounds, plan.pool_bytes, len(plan.offsets) - len(later),
    )
    return CopyJob(
        gate, [entry[1:] for entry in later], [entry[0] for entry in later],
        waits_for=plan.waits_for,
        timeout_s=timeout_s, what=what, advice=advice,
    )
