"""Write buckets: which of one rank's checkpoint items share a file, and in what order.

A *bucket* is the content of one ``.distcp`` file: the resolved data of some write items
of this rank. Buckets are laid out in the trainer on every rank (``prepare_write_data``),
staged to host memory by :mod:`megatron_async.staging`, and written by the background
writer (:mod:`megatron_async.writer.bucket_io`), one bucket per thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import io
import operator
import os
from itertools import compress, repeat
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, TypeVar

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from megatron_async.errors import CheckpointValidationError

__all__ = [
    "WriteBucket",
    "BucketLayout",
    "item_num_bytes",
    "is_empty_chunk",
    "balance_by_size",
    "assign_buckets",
    "materialize_buckets",
    "ConsistentDataIdentifier",
    "PreparedWrite",
    "ResolvedPlanData",
    "layout_key",
    "prepare_buckets",
    "unpack_resolved_plan_data",
]

T = TypeVar("T")

BytesData = List[Tuple[WriteItem, io.BytesIO]]
TensorData = List[Tuple[WriteItem, torch.Tensor]]


class WriteBucket(NamedTuple):
    """The content of one checkpoint file.

    Unpacks like megatron-core's ``(file_path, storage_key, (bytes_data, tensor_data))``
    tuple, so write functions of either library accept it.

    Attributes:
        file_path: absolute path of the file to write.
        file_name: the file's name relative to the checkpoint directory; it is the
            storage key that ``.metadata`` records for every item of the bucket.
        data: ``(bytes_data, tensor_data)``: lists of ``(write_item, data)`` pairs.
    """

    file_path: str
    file_name: str
    data: Tuple[BytesData, TensorData]


def item_num_bytes(item: WriteItem, data: Any = None) -> int:
    """Return the number of bytes ``item`` occupies: its chunk for tensors, its length for bytes."""
    if item.type == WriteItemType.BYTE_IO:
        return len(data.getbuffer()) if isinstance(data, io.BytesIO) else 0
    if item.tensor_data is None:
        return 0
    numel = 1
    for size in item.tensor_data.chunk.sizes:
        numel *= size
    return numel * torch._utils._element_size(item.tensor_data.properties.dtype)


def is_empty_chunk(item: WriteItem) -> bool:
    """Whether ``item`` is a tensor chunk without elements (a zero-length shard).

    With uneven splits several ranks hold such a chunk at the same offset (often the
    end of the tensor) without overlapping: it covers no element.
    """
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return False
    return 0 in tuple(item.tensor_data.chunk.sizes)


def balance_by_size(sized: Sequence[Tuple[T, int]], bins: int) -> List[List[T]]:
    """Split ``(value, num_bytes)`` pairs into ``bins`` lists with sums as even as possible.

    Largest first, each into the currently lightest bin; ties go to the lower bin index,
    so the split is deterministic for a given input.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    buckets: List[List[T]] = [[] for _ in range(bins)]
    heap = [(0, idx) for idx in range(bins)]
    order = sorted(range(len(sized)), key=lambda i: (-sized[i][1], i))
    for i in order:
        total, idx = heapq.heappop(heap)
        buckets[idx].append(sized[i][0])
        heapq.heappush(heap, (total + sized[i][1], idx))
    return buckets


BucketLayout = List[Tuple[str, List[int]]]
"""Which items go to which file: ``(file name prefix, positions of the items)`` per bucket."""


def assign_buckets(
    resolved: Sequence[Tuple[WriteItem, Any]],
    thread_count: int,
    separation_hint: Optional[str] = None,
) -> BucketLayout:
    """Decide which items share a file: at most ``thread_count`` size-balanced buckets.

    Items whose key starts with ``separation_hint`` never share a file with other items
    and their file names start with the hint (megatron-core's convention, which its
    ``remove_sharded_tensors`` relies on). With a hint, a rank that has both kinds of
    items writes at least two files even when ``thread_count`` is 1.

    Args:
        resolved: ``(write_item, data)`` pairs, data being a tensor or ``io.BytesIO``.
        thread_count: the number of buckets to aim for.
        separation_hint: key prefix of items that go to separate files.

    Returns:
        The non-empty buckets as ``(file name prefix, item positions)``.
    """
    hinted, others = [], []
    for pos, (item, data) in enumerate(resolved):
        is_hinted = separation_hint is not None and item.index.fqn.startswith(separation_hint)
        (hinted if is_hinted else others).append((pos, item_num_bytes(item, data)))

    other_bins = hinted_bins = thread_count  # one kind of item only: all bins for it
    if hinted and others:
        hinted_bins = max(1, thread_count // 2)
        other_bins = max(1, thread_count - hinted_bins)
    layout: BucketLayout = []
    for name_prefix, sized, bins in (("", others, other_bins), (separation_hint, hinted, hinted_bins)):
        if sized:
            layout += [(name_prefix, sorted(b)) for b in balance_by_size(sized, bins) if b]
    return layout


_FIRST = operator.itemgetter(0)
_TYPE = operator.attrgetter("type")


def materialize_buckets(
    resolved: Sequence[Tuple[WriteItem, Any]],
    layout: BucketLayout,
    checkpoint_dir: str,
    storage_prefix: str,
) -> List[WriteBucket]:
    """Build the buckets of ``layout``; file ``idx`` is ``{name prefix}{storage_prefix}{idx}.distcp``.

    Within a bucket, bytes items come first, then tensors in plan order.
    """
    buckets = []
    byte_io = WriteItemType.BYTE_IO  # looked up once
    for idx, (name_prefix, positions) in enumerate(layout):
        file_name = f"{name_prefix}{storage_prefix}{idx}{DEFAULT_SUFFIX}"
        # map and compress: no Python bytecode per item (thousands per bucket, every save)
        content = list(map(resolved.__getitem__, positions))
        kinds = list(map(_TYPE, map(_FIRST, content)))
        if byte_io not in kinds:
            bytes_data, tensor_data = [], content
        else:
            bytes_data = list(compress(content, map(operator.is_, kinds, repeat(byte_io))))
            tensor_data = list(compress(content, map(operator.is_not, kinds, repeat(byte_io))))
        buckets.append(
            WriteBucket(os.path.join(checkpoint_dir, file_name), file_name, (bytes_data, tensor_data))
        )
    return buckets


@dataclasses.dataclass(frozen=True)
class ConsistentDataIdentifier:
    """Names the reusable staging buffers of one bucket layout (trainer side).

    Travels in ``resolved_plan_data`` instead of the buffers themselves; the buffers stay
    in the stager's :class:`~megatron_async.staging.budget.StagingBufferCache`.

    Attributes:
        key: a digest of everything that decides the buffers' shapes.
    """

    key: str


@dataclasses.dataclass(frozen=True)
class PreparedWrite:
    """What a writer's ``prepare_write_data`` made of one save's plan (trainer, every rank).

    Returned forward to the saver, which hands it to its caller: a later save of the
    same structure reuses the layout and the staging key without planning.

    Attributes:
        write_buckets: the buckets, with this save's data.
        layout: which items share a file, in which order.
        staging_key: the key of the layout's reusable staging buffers, or None.
    """

    write_buckets: List[WriteBucket]
    layout: "BucketLayout"
    staging_key: Optional[str]


ResolvedPlanData = Tuple[str, Tuple[Optional[ConsistentDataIdentifier], List[WriteBucket]]]
"""``(checkpoint_dir, (identifier, write_buckets))``: what ``preload_tensors`` stages."""


def layout_key(plan: SavePlan, thread_count: int, separation_hint: Optional[str]) -> str:
    """A digest of everything that decides the bucket layout and the staging buffers' shapes."""
    digest = hashlib.sha1(repr((thread_count, separation_hint, plan.storage_data)).encode())
    for item in plan.items:
        tensor_data = item.tensor_data
        shape = (
            (tuple(tensor_data.chunk.sizes), str(tensor_data.properties.dtype))
            if tensor_data is not None
            else None
        )
        offset = tuple(item.index.offset) if item.index.offset is not None else None
        digest.update(repr((item.index.fqn, offset, item.type.value, shape)).encode())
    return digest.hexdigest()


def prepare_buckets(
    plan: SavePlan,
    resolved: Sequence[Tuple[WriteItem, Any]],
    checkpoint_dir: str,
    thread_count: int,
    separation_hint: Optional[str],
    reuse_buffers: bool,
    layout: Optional[BucketLayout] = None,
    staging_key: Optional[str] = None,
) -> PreparedWrite:
    """Lay out a final plan's resolved items in buckets (trainer, every rank).

    Args:
        plan: this rank's final plan; ``plan.storage_data`` holds the storage prefix.
        resolved: ``(write_item, data)`` for every item of ``plan``, in plan order.
        checkpoint_dir: where the files go.
        thread_count, separation_hint: the writer's options that decide the layout.
        reuse_buffers: compute the staging key (``use_cached_data_structure``).
        layout: a layout made for exactly these items (the ``layout`` of an earlier
            save's :class:`PreparedWrite`), or None to compute it.
        staging_key: with ``reuse_buffers``, the key that ``layout`` had, or None to
            compute it.

    Raises:
        CheckpointValidationError: planning has not finished (the plan names no file prefix).
    """
    if not isinstance(plan.storage_data, _StoragePrefix):
        raise CheckpointValidationError(
            "the plan has no storage prefix; finish planning (prepare_global_plan or "
            "prepare_decentralized_global_plan) before prepare_write_data"
        )
    if reuse_buffers and staging_key is None:
        staging_key = layout_key(plan, thread_count, separation_hint)
    if layout is None:  # deterministic: the same items give the same layout (and buffers)
        layout = assign_buckets(resolved, thread_count, separation_hint)
    buckets = materialize_buckets(resolved, layout, checkpoint_dir, plan.storage_data.prefix)
    return PreparedWrite(buckets, layout, staging_key if reuse_buffers else None)


def unpack_resolved_plan_data(
    resolved_plan_data: Any,
) -> Tuple[Optional[ConsistentDataIdentifier], Sequence[WriteBucket]]:
    """Return ``(identifier, write_buckets)`` of a writer's ``resolved_plan_data`` (trainer).

    Raises:
        CheckpointValidationError: anything but what ``prepare_write_data`` leaves.
    """
    try:
        _, (identifier, write_buckets) = resolved_plan_data
    except (TypeError, ValueError):
        identifier, write_buckets = None, None
    if (identifier is not None and not isinstance(identifier, ConsistentDataIdentifier)) or not (
        isinstance(write_buckets, (list, tuple))
        and all(isinstance(b, WriteBucket) for b in write_buckets)
    ):
        raise CheckpointValidationError(
            "preload_tensors expects (checkpoint_dir, (ConsistentDataIdentifier or None, "
            "write_buckets)), the writer's resolved_plan_data after prepare_write_data; got "
            f"{type(resolved_plan_data).__name__}"
        )
    return identifier, write_buckets
