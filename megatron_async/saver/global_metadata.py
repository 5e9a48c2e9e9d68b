"""Build the global metadata of a save from every rank's local plan (coordinator).

With decentralized planning every rank writes its own local plan as it is, so the global
plan of DCP's ``DefaultSavePlanner`` (deduplicate, rewrite every item's index hint,
validate) does work whose result nobody uses: at a million items, seconds of the
coordinator's time with every rank waiting, mostly in objects made per item.
:func:`build_metadata` builds the metadata from the plans as gathered, without a new
object per chunk (equal chunk sizes and tensor properties are made one shared object,
which the pickle then writes once), and :func:`validate_chunks` checks it with DCP's rules.

Items that two ranks plan are refused before any of that, except tensor chunks without
elements (:func:`index_items`). No collective runs here: the saver gathers the plans and
agrees on the outcome.

Equal values made one object also shrink what the ranks send (docs/design.md, "The
first save's coordinator work is linear"; docs/benchmarks.md, "Shared sizes"): a
``torch.Size`` pickles through Python (about 2 us) while a repeated object is one memo
reference, so after :func:`share_equal_sizes` a plan pickles a few dozen sizes instead of
thousands. Values do not change, only which object holds them, so plans compare, digest
and load exactly as before.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from bisect import bisect_right, insort
from operator import add, le
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from megatron_async.core.gc_pause import paused_gc
from megatron_async.errors import CheckpointValidationError
from megatron_async.saver.metadata_cache import PLAN_DIGESTS_ATTR, plan_digest, properties_key

__all__ = [
    "build_global_metadata",
    "share_equal_sizes",
    "without_redundant_empty_chunks",
    "build_metadata",
    "plans_globally_like_dcp",
    "index_items",
    "validate_chunks",
]


_SHOWN_ERRORS = 5


def build_metadata(all_local_plans: Sequence[SavePlan]) -> Metadata:
    """The metadata DCP's global planning makes of these plans, validated (coordinator).

    Equal to ``DefaultSavePlanner(flatten_state_dict=False).create_global_plan`` on the
    plans without their redundant empty chunks: one entry per fqn in order of first
    appearance, each tensor's chunks in rank and item order, the first item's properties
    and global size.

    Raises:
        CheckpointValidationError: an item planned by two ranks, or an invalid chunk
            layout (out of bounds, overlapping, missing).
    """
    skipped = index_items(all_local_plans)
    state: Dict[str, object] = {}
    shard, byte_io = WriteItemType.SHARD, WriteItemType.BYTE_IO
    # Equal values shared, so that the pickle writes each once (a reference after that).
    shared_sizes: Dict[torch.Size, torch.Size] = {}
    shared_properties: Dict[tuple, TensorProperties] = {}
    for plan in all_local_plans:
        for item in plan.items:
            fqn = item.index.fqn
            if item.type is not shard and fqn in state:
                raise CheckpointValidationError(
                    f"{fqn!r} is saved whole by more than one rank; each rank must save it "
                    "under a name of its own, or as a shard with replica_id 0 on one rank."
                )
            if item.type is byte_io:
                state[fqn] = BytesStorageMetadata()
                continue
            if skipped and id(item) in skipped:
                continue
            data = item.tensor_data
            if data is None or data.chunk is None:
                raise CheckpointValidationError(
                    f"tensor {fqn!r} is planned without its chunk's bounds; plan it as a "
                    "tensor or a shard with its offsets and sizes."
                )
            entry = state.get(fqn)
            if entry is None:
                properties = shared_properties.setdefault(properties_key(data.properties), data.properties)
                entry = state[fqn] = TensorStorageMetadata(properties, data.size, [])
            _share(data.chunk, "sizes", shared_sizes)
            entry.chunks.append(data.chunk)
    metadata = Metadata(state)
    validate_chunks(metadata, several_ranks=len(all_local_plans) > 1)
    return metadata


def validate_chunks(metadata: Metadata, several_ranks: bool) -> None:
    """Check every tensor's chunks: bounds, overlaps and, with several ranks, the fill.

    Runs on the coordinator. The rules are DCP's (``_validate_global_plan``); the sweep
    keeps, per tensor, only the chunks that reach past the current one's start along
    the tensor's longest axis, so tiled layouts cost one comparison per chunk.

    Raises:
        CheckpointValidationError: listing the first errors and how many there are.
    """
    errors: List[str] = []
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata) or len(entry.size) == 0:
            continue
        errors.extend(_tensor_errors(fqn, entry, several_ranks))
    if errors:
        shown = "; ".join(errors[:_SHOWN_ERRORS])
        more = f" (and {len(errors) - _SHOWN_ERRORS} more)" if len(errors) > _SHOWN_ERRORS else ""
        raise CheckpointValidationError(
            f"invalid global save plan: {shown}{more}. Every element of a tensor must be "
            "saved by exactly one rank: check the sharding (offsets, global shape, "
            "replica_id) of these tensors."
        )


def _tensor_errors(fqn: str, entry: TensorStorageMetadata, several_ranks: bool) -> List[str]:
    size = tuple(entry.size)
    ndim = len(size)
    chunks = entry.chunks
    errors = []
    volume = 0
    for chunk in chunks:
        offsets, sizes = chunk.offsets, chunk.sizes
        if (
            len(offsets) != ndim
            or len(sizes) != ndim
            or min(offsets) < 0
            or min(sizes) < 0
            or not all(map(le, map(add, offsets, sizes), size))
        ):
            errors.append(
                f"{fqn}: chunk at offsets {tuple(offsets)} of sizes {tuple(sizes)} is out of "
                f"bounds of the tensor's size {size}"
            )
        volume += math.prod(sizes)
    if len(chunks) > 1:
        errors.extend(_overlap_errors(fqn, chunks, size))
    expected = math.prod(size)
    if several_ranks and volume != expected:
        errors.append(
            f"{fqn}: chunks hold {volume} elements, the tensor {expected} (invalid fill: a "
            "shard is missing or saved twice)"
        )
    return errors


def _overlap_errors(fqn: str, chunks: Sequence, size: Tuple[int, ...]) -> List[str]:
    """Pairs of overlapping chunks, by a sweep along the tensor's longest axis."""
    axis = max(range(len(size)), key=size.__getitem__)
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].offsets[axis], tuple(chunks[i].offsets)))
    active: List[Tuple[int, int]] = []  # (end along the axis, chunk), sorted
    errors = []
    for i in order:
        chunk = chunks[i]
        start = chunk.offsets[axis]
        if active:
            passed = bisect_right(active, (start, sys.maxsize))
            if passed:
                del active[:passed]
            for _, j in active:
                if _boxes_overlap(chunk, chunks[j]):
                    errors.append(
                        f"{fqn}: overlapping chunks at offsets {tuple(chunk.offsets)} and "
                        f"{tuple(chunks[j].offsets)}"
                    )
        insort(active, (start + chunk.sizes[axis], i))
    return errors


def _boxes_overlap(one, other) -> bool:
    """DCP's box test: neither box lies wholly on one side of the other along any axis."""
    for a_offset, a_size, b_offset, b_size in zip(one.offsets, one.sizes, other.offsets, other.sizes):
        if a_offset >= b_offset + b_size or b_offset >= a_offset + a_size:
            return False
    return True


def index_items(all_local_plans: Sequence[SavePlan], refuse_duplicates: bool = True) -> Set[int]:
    """Refuse items that several ranks plan; return the ids of redundant empty chunks.

    DCP's global planning silently deduplicates identical chunks, but with decentralized
    planning every rank writes its own plan, so which copy the metadata points to would
    depend on the order of the results. Chunks without elements are exempt: they overlap
    nothing, and the commit points the metadata at one of them. Of the empty chunks at
    one ``(fqn, offset)`` only one is listed, never in place of a chunk with data: the
    chunk with data is kept, else the lowest rank's empty chunk, and the others' ids are
    returned. One pass over the items; keys are ``(fqn, offset)`` tuples, hashed in C (a
    ``MetadataIndex`` is not).

    Args:
        all_local_plans: every rank's local plan, in rank order.
        refuse_duplicates: False for central planning, where DCP deduplicates the
            replicas that several ranks plan.

    Raises:
        CheckpointValidationError: naming the first items planned by several ranks.
    """
    owner: Dict[tuple, int] = {}
    duplicates: Dict[tuple, List[int]] = {}
    empty = []
    for rank, plan in enumerate(all_local_plans):
        for item in plan.items:
            data = item.tensor_data
            if data is not None and data.chunk is not None and 0 in data.chunk.sizes:
                empty.append(item)
                continue
            index = item.index
            key = (index.fqn, index.offset)
            known = len(owner)
            first = owner.setdefault(key, rank)
            if len(owner) == known and refuse_duplicates:  # planned before
                duplicates.setdefault(key, [first]).append(rank)
    if duplicates:
        shown = "; ".join(
            f"{fqn} at offset {tuple(offset or ())} on ranks {ranks}"
            for (fqn, offset), ranks in list(duplicates.items())[:_SHOWN_ERRORS]
        )
        raise CheckpointValidationError(
            f"{len(duplicates)} item(s) are saved by more than one rank (overlapping shards): "
            f"{shown}. Exactly one rank must hold each shard with replica_id 0."
        )
    skipped, listed = set(), set()
    for item in empty:  # in rank order
        key = (item.index.fqn, item.index.offset)
        if key in owner or key in listed:
            skipped.add(id(item))
        else:
            listed.add(key)
    return skipped


@paused_gc()  # an index key per item; no cycles
def build_global_metadata(
    planner: SavePlanner,
    all_local_plans: List[SavePlan],
    plan_digests: Optional[Sequence[bytes]] = None,
) -> Metadata:
    """Build the global metadata of a decentralized save from every rank's local plan.

    Runs on the coordinator; refuses items planned by two ranks. The metadata lists each
    ``(fqn, offset)`` once, as megatron-core's does. Only for a planner whose global
    planning is DCP's own (:func:`plans_globally_like_dcp`; the saver plans the others
    centrally): :func:`build_metadata` makes the metadata that planning would make.

    Args:
        planner: the save planner; its ``global_plan`` and ``metadata`` are set, as DCP's
            global planning sets them (the plans keep their index hints: a decentralized
            save writes every rank's plan as it is).
        all_local_plans: every rank's local plan, in rank order.
        plan_digests: every rank's :func:`~megatron_async.saver.metadata_cache.plan_digest`
            of its plan, as the ranks computed them; computed here when None.

    Returns:
        The metadata, with every rank's plan digest attached
        (:mod:`~megatron_async.saver.metadata_cache`), so that a resumed job can skip the
        plan gather.

    Raises:
        CheckpointValidationError: overlapping or missing shards, or another invalid plan.
    """
    metadata = build_metadata(all_local_plans)
    planner.global_plan, planner.metadata = all_local_plans, metadata
    if plan_digests is None:
        plan_digests = [plan_digest(plan) for plan in all_local_plans]
    setattr(metadata, PLAN_DIGESTS_ATTR, list(plan_digests))
    return metadata


def plans_globally_like_dcp(planner: SavePlanner) -> bool:
    """Whether ``planner``'s global planning is DCP's default one, unchanged (megatron-core's
    planner, for one): not an override, flattened state dicts or DCP's plan caching."""
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


def without_redundant_empty_chunks(all_local_plans: List[SavePlan]) -> List[SavePlan]:
    """Leave out the empty chunks that another item already describes (coordinator).

    ``MetadataIndex`` equality ignores the index hint, so the metadata (and DCP's
    deduplication) treat items at the same ``(fqn, offset)`` as one. Left to DCP, which
    copy survives depends on plan sizes, and an empty chunk could replace a chunk with
    data at its offset (a "missing shard" error). Which are left out is
    :func:`index_items`'s rule; the plans are returned unchanged when nothing is left out.
    For central planning, where DCP deduplicates the replicas that several ranks plan.
    """
    left_out = index_items(all_local_plans, refuse_duplicates=False)
    if not left_out:
        return all_local_plans
    return [
        dataclasses.replace(plan, items=[item for item in plan.items if id(item) not in left_out])
        for plan in all_local_plans
    ]


def share_equal_sizes(plan: SavePlan) -> SavePlan:
    """Make equal ``torch.Size`` values of ``plan``'s items one object; return ``plan``.

    Every rank, on its own local plan, before it is gathered; changes it in place.
    """
    shared: Dict[torch.Size, torch.Size] = {}
    for item in plan.items:
        _share(item.index, "offset", shared)
        data = item.tensor_data
        if data is None:
            continue
        _share(data, "size", shared)
        if data.chunk is not None:  # a plan without one is refused by global planning
            _share(data.chunk, "offsets", shared)
            _share(data.chunk, "sizes", shared)
    return plan


def _share(owner: Any, field: str, shared: Dict[torch.Size, torch.Size]) -> None:
    """Set ``owner.<field>`` to the first equal ``torch.Size`` in ``shared`` (DCP's plan
    dataclasses are frozen: set as their own ``__init__`` does). Only ``torch.Size``
    values are shared: a tuple equal to one stays a tuple."""
    value = getattr(owner, field, None)
    if type(value) is torch.Size:
        object.__setattr__(owner, field, shared.setdefault(value, value))
