"""Build the global metadata of a save from every rank's local plan (coordinator only).

With decentralized planning every rank writes its own local plan as it is, so the
coordinator refuses items planned by two ranks, except tensor chunks without elements,
which uneven splits (distributed optimizer buckets, MoE experts) put on several ranks at
one offset. Central planning goes through the same filter before DCP deduplicates. No
collective runs here: the saver gathers the plans and agrees on the outcome.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from megatron_async.core.gc_pause import paused_gc
from megatron_async.errors import CheckpointValidationError
from megatron_async.saver.global_plan import build_metadata, index_items
from megatron_async.saver.plan_digests import attach_plan_digests

__all__ = ["build_global_metadata", "without_redundant_empty_chunks"]


@paused_gc()  # an index key per item; no cycles
def build_global_metadata(
    planner: SavePlanner,
    all_local_plans: List[SavePlan],
    plan_digests: Optional[Sequence[bytes]] = None,
) -> Metadata:
    """Build the global metadata of a decentralized save from every rank's local plan.

    Runs on the coordinator; refuses items planned by two ranks (see the module
    docstring). The metadata lists each ``(fqn, offset)`` once, as megatron-core's does.

    DCP's own planners (``DefaultSavePlanner`` and megatron-core's ``MCoreSavePlanner``,
    which add nothing to its global planning) are not run: their global plan is not used
    by a decentralized save, and :func:`~megatron_async.saver.global_plan.build_metadata`
    makes the same metadata in one pass. A planner that plans globally in its own way
    (an override, flattened state dicts, DCP's plan caching) is run as before.

    Args:
        planner: the save planner; its ``global_plan`` and ``metadata`` are set, as DCP's
            global planning sets them.
        all_local_plans: every rank's local plan, in rank order.
        plan_digests: every rank's :func:`~megatron_async.saver.plan_digests.plan_digest`
            of its plan, as the ranks computed them; computed here when None.

    Returns:
        The metadata, with every rank's plan digest attached
        (:mod:`~megatron_async.saver.plan_digests`), so that a resumed job can skip the
        plan gather.

    Raises:
        CheckpointValidationError: overlapping or missing shards, or another invalid plan.
    """
    if _plans_like_dcp(planner):
        metadata = build_metadata(all_local_plans)
        # As DCP's global planning leaves them (the plans keep their index hints: a
        # decentralized save writes every rank's plan as it is).
        planner.global_plan, planner.metadata = all_local_plans, metadata
    else:
        plans = without_redundant_empty_chunks(all_local_plans, refuse_duplicates=True)
        try:
            _, metadata = planner.create_global_plan(plans)
        except ValueError as exc:  # DCP's validation: overlapping, out-of-bounds or missing chunks
            raise CheckpointValidationError(f"invalid global save plan: {exc}") from exc
    # Stored in .metadata so that a resumed job can skip this gather.
    attach_plan_digests(metadata, all_local_plans, plan_digests)
    return metadata


def _plans_like_dcp(planner: SavePlanner) -> bool:
    """Whether ``planner``'s global planning is DCP's default one, unchanged."""
    if not isinstance(planner, DefaultSavePlanner):
        return False
    cls = type(planner)
    unchanged = all(
        getattr(cls, name, None) is getattr(DefaultSavePlanner, name, None)
        for name in ("create_global_plan", "_create_global_plan", "_dedup_save_plans")
    )
    return (
        unchanged
        and not getattr(planner, "flatten_state_dict", False)
        and not getattr(planner, "_enable_plan_caching", False)
    )


def without_redundant_empty_chunks(
    all_local_plans: List[SavePlan], refuse_duplicates: bool = False
) -> List[SavePlan]:
    """Leave out the empty chunks that another item already describes (coordinator).

    ``MetadataIndex`` equality ignores the index hint, so the metadata (and DCP's
    deduplication) treat items at the same ``(fqn, offset)`` as one. Left to DCP, which
    copy survives depends on plan sizes, and an empty chunk could replace a chunk with
    data at its offset (a "missing shard" error). Which are left out is
    :func:`~megatron_async.saver.global_plan.index_items`'s rule; the plans are returned
    unchanged when nothing is left out.

    Raises:
        CheckpointValidationError: with ``refuse_duplicates``, items that several ranks plan.
    """
    left_out = index_items(all_local_plans, refuse_duplicates)
    if not left_out:
        return all_local_plans
    return [
        dataclasses.replace(plan, items=[item for item in plan.items if id(item) not in left_out])
        for plan in all_local_plans
    ]
