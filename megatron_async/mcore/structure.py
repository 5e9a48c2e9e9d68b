"""Reuse the previous save's plan while the sharded state dict keeps its structure.

A full planning translates megatron-core's sharded state dict into PyTorch DCP's form,
builds the local plan, compares it with the cached one, resolves every write item to its
data and splits the items into files. While training, the structure of the state dict
(which shards, of which shapes, types and offsets) stays the same from save to save and
only the values change, so all of that gives the same answer again, at a cost of about a
second on the training thread at tens of thousands of tensors per rank.

This module lets the strategy skip it. Everything here runs on the training thread of
every rank and is local (no collective): :func:`describe_structure` fingerprints the
sharded state dict in one walk, :func:`bind_plan` records after a full planning where
each item of the plan takes its data from (or finds no unambiguous binding: every save
then plans in full), and :func:`rebind` resolves the bound items to the data of a new
state dict with the same fingerprint.

Not in the fingerprint: a tensor's device and whether it is pinned. Staging copies from
any device, and the reused metadata keeps the first save's ``pin_memory`` flag, which no
loader reads.

The strategy reuses a plan only once one all-reduce established that the fingerprint is
unchanged on every rank, as the global metadata describes every rank's items.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from megatron_async.buckets.layout import BucketLayout, PreparedWrite

__all__ = ["Structure", "PlanBinding", "describe_structure", "bind_plan", "rebind"]

logger = logging.getLogger(__name__)

# Positions in a fingerprint entry. A ShardedTensor's entry is (type, key, global_offset,
# replica_id, global_shape, local_shape, data shape, dtype, prepend_axis_num,
# axis_fragmentations); a ShardedObject's is (type, unique_key, None, replica_id).
_TYPE, _KEY, _OFFSET, _REPLICA = range(4)

_BYTES = object()
"""Marks a binding entry whose data is the serialized ShardedObjects of its positions."""


@dataclasses.dataclass(frozen=True)
class Structure:
    """The structure of one sharded state dict and the data of its shards.

    Attributes:
        fingerprint: one tuple per ShardedTensor or ShardedObject, in megatron-core's
            traversal order; equal fingerprints mean equal local plans.
        sources: the matching data: a ShardedTensor's tensor or a ShardedObject's object.
            Never cached across saves (it would keep the old tensors alive).
    """

    fingerprint: List[tuple]
    sources: List[Any]


def describe_structure(
    sharded_state_dict: Mapping, previous: Optional[List[tuple]] = None
) -> Optional[Structure]:
    """Walk a preprocessed sharded state dict once and return its :class:`Structure`.

    Runs on the training thread. Visits values in the order of megatron-core's
    ``flatten_state_dict`` (mapping values in insertion order, list elements in order), so
    the fingerprint follows the order of the plan's items.

    Args:
        sharded_state_dict: the sharded state dict megatron-core hands to the strategy.
        previous: the fingerprint of the previous save, if any. If the new one equals
            it, the returned structure shares ``previous`` (``structure.fingerprint is
            previous``) and the new list is dropped at once: at tens of thousands of
            shards, every object that outlives a save adds to the work of Python's next
            full garbage collection, which runs on the training thread.

    Returns:
        The structure, or None when the state dict holds anything but nested mappings
        and non-empty lists of ShardedTensors and ShardedObjects with data: megatron-core
        refuses some of those (a full planning then reports them) and this module does
        not rebind the others.
    """
    if not isinstance(sharded_state_dict, Mapping):
        return None
    fingerprint: List[tuple] = []
    sources: List[Any] = []
    if not _walk(sharded_state_dict.values(), fingerprint.append, sources.append):
        return None
    # One list comparison in C, after the walk: comparing entry by entry while walking
    # costs a Python call per shard (about 15% of the walk at thousands of shards).
    if previous is not None and fingerprint == previous:
        return Structure(previous, sources)
    return Structure(fingerprint, sources)


def _walk(values, add_entry, add_source) -> bool:
    for value in values:
        if type(value) is ShardedTensor or isinstance(value, ShardedTensor):  # exact type first
            data = value.data
            if not isinstance(data, torch.Tensor) or value.flattened_range is not None:
                return False
            add_entry(
                (
                    type(value),
                    value.key,
                    value.global_offset,
                    value.replica_id,
                    value.global_shape,
                    value.local_shape,
                    data.shape,
                    data.dtype,
                    value.prepend_axis_num,
                    value.axis_fragmentations,
                )
            )
            add_source(data)
        elif isinstance(value, Mapping):
            if not _walk(value.values(), add_entry, add_source):
                return False
        elif isinstance(value, ShardedObject):
            add_entry((type(value), value.unique_key, None, value.replica_id))
            add_source(value.data)
        elif isinstance(value, list) and value:
            # megatron-core hands an empty list, or a list without shards, to its
            # visitor as one value and refuses it; a full planning reports that.
            if not _walk(value, add_entry, add_source):
                return False
        else:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class PlanBinding:
    """Where each item of a cached plan takes its data from, and how its file layout looks.

    Attributes:
        items: the items of the final plan, in plan order.
        positions: per item, the position in :attr:`Structure.sources` of the data it
            takes by reference (0 for the items in ``derived``).
        derived: ``(index in items, where, shape)`` for the few items whose data is
            derived: ``(source position, shape to reshape to)`` for a tensor,
            ``(positions of the ShardedObjects, _BYTES)`` for serialized objects.
        layout: the bucket layout the writer chose for the plan.
        staging_key: the writer's key of that layout's staging buffers (None without
            ``use_cached_data_structure``).
    """

    items: List[WriteItem]
    positions: List[int]
    derived: List[Tuple[int, Union[int, Tuple[int, ...]], Any]]
    layout: BucketLayout
    staging_key: Optional[str]


def bind_plan(
    structure: Structure, plan: SavePlan, prepared: PreparedWrite, keep_only_main_replica: bool
) -> Optional[PlanBinding]:
    """Record where the items of a fully planned save take their data from.

    Runs on the training thread after a full planning, with the structure described
    before megatron-core's translation (which replaces some shards' ``data``).

    Args:
        structure: the structure of the state dict that was planned.
        plan: the final plan of this rank (the writer's buckets hold its items).
        prepared: what the writer made of ``plan`` (its buckets, layout and staging key).
        keep_only_main_replica: whether the strategy saved only main replicas.

    Returns:
        The binding, or None when an item cannot be bound unambiguously or the rebinding
        rule does not reproduce the data the planner resolved (the caller then plans
        every save in full).
    """
    resolved = {
        id(item): data
        for bucket in prepared.write_buckets
        for pairs in bucket.data
        for item, data in pairs
    }
    tensors: Dict[Tuple[str, tuple], int] = {}
    objects: Dict[str, List[int]] = {}
    for pos, entry in enumerate(structure.fingerprint):
        if keep_only_main_replica and not is_main_replica(entry[_REPLICA]):
            continue
        if entry[_OFFSET] is None:
            objects.setdefault(entry[_KEY], []).append(pos)
        else:
            where = (entry[_KEY], tuple(entry[_OFFSET]))
            tensors[where] = -1 if where in tensors else pos  # -1: two shards, ambiguous

    positions: List[int] = []
    derived: List[Tuple[int, Any, Any]] = []
    for idx, item in enumerate(plan.items):
        data = resolved.get(id(item))
        if item.type == WriteItemType.BYTE_IO:
            owners = tuple(objects.get(item.index.fqn, ()))
            if not owners or not _same_bytes(structure.sources, owners, data):
                return _unbound(item, "its ShardedObjects do not serialize to the planned bytes")
            positions.append(0)
            derived.append((idx, owners, _BYTES))
            continue
        offset = tuple(item.index.offset) if item.index.offset is not None else None
        pos = tensors.get((item.index.fqn, offset), -1)
        if pos < 0 or not isinstance(data, torch.Tensor):
            return _unbound(item, "no single shard matches it")
        source = structure.sources[pos]
        shape = None if data.shape == source.shape else data.shape
        if not _same_view(source, _derive(source, shape), data):
            return _unbound(item, "its shard does not rebind to the planned data")
        positions.append(pos if shape is None else 0)
        if shape is not None:
            derived.append((idx, pos, shape))
    return PlanBinding(list(plan.items), positions, derived, prepared.layout, prepared.staging_key)


def rebind(binding: PlanBinding, structure: Structure) -> List[Tuple[WriteItem, Any]]:
    """Resolve the bound items to the data of a state dict with the bound fingerprint.

    Runs on the training thread. Tensors are taken by reference (staging copies them
    later); ShardedObjects are serialized here, as a full planning would.

    Returns:
        ``(write_item, data)`` for every item, in plan order.
    """
    sources = structure.sources
    data = list(map(sources.__getitem__, binding.positions))  # no bytecode per tensor
    for idx, where, shape in binding.derived:
        if shape is _BYTES:
            data[idx] = _serialize([sources[pos] for pos in where])
        else:
            data[idx] = _derive(sources[where], shape)
    return list(zip(binding.items, data))


def _derive(source: torch.Tensor, shape: Optional[torch.Size]) -> torch.Tensor:
    """The data a full planning resolves for ``source``: itself, or reshaped to ``shape``.

    megatron-core views a shard with prepended axes as ``(1,) * n + local_shape`` (after
    making it contiguous); ``reshape`` gives that view, copying only a non-contiguous
    shard, as megatron-core does.
    """
    return source if shape is None else source.reshape(shape)


def _same_view(source: torch.Tensor, derived: torch.Tensor, planned: torch.Tensor) -> bool:
    if (derived.dtype, derived.shape, derived.stride()) != (
        planned.dtype,
        planned.shape,
        planned.stride(),
    ):
        return False
    # A contiguous shard is never copied: both must point at its memory. A non-contiguous
    # one is copied by the planner and by the rebinding alike.
    return not source.is_contiguous() or derived.data_ptr() == planned.data_ptr()


def _serialize(objects: List[Any]) -> io.BytesIO:
    """Serialize the objects of one ShardedObject key as megatron-core stores them."""
    buffer = io.BytesIO()
    torch.save(objects, buffer)
    return buffer


def _same_bytes(sources: List[Any], positions: Tuple[int, ...], planned: Any) -> bool:
    if not isinstance(planned, io.BytesIO):
        return False
    return _serialize([sources[pos] for pos in positions]).getvalue() == planned.getvalue()


def _unbound(item: WriteItem, why: str) -> None:
    logger.debug(
        "the plan of this save cannot be reused while the structure stays the same: item "
        "%s at offset %s: %s; every save plans in full",
        item.index.fqn,
        item.index.offset,
        why,
    )
    return None
