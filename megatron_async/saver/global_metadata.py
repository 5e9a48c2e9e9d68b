"""Build the global metadata of a save from every rank's local plan (coordinator only).

With decentralized planning every rank writes its own local plan as it is, so the
coordinator refuses items planned by two ranks, except tensor chunks without elements,
which uneven splits (distributed optimizer buckets, MoE experts) put on several ranks at
one offset. Central planning goes through the same filter before DCP deduplicates. No
collective runs here: the saver gathers the plans and agrees on the outcome.
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from megatron_async.errors import CheckpointValidationError
from megatron_async.writer.layout import is_empty_chunk

__all__ = ["build_global_metadata", "without_redundant_empty_chunks"]


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
        _, metadata = planner.create_global_plan(without_redundant_empty_chunks(all_local_plans))
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


def without_redundant_empty_chunks(all_local_plans: List[SavePlan]) -> List[SavePlan]:
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
