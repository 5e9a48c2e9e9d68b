"""Host staging of write buckets: a real snapshot of every tensor, in shared-memory buffers.

Staging runs in the trainer (the request's ``preload_fn``, called by every caller before
the background part starts). It copies every tensor into a host buffer, so the trainer
may update its tensors in place as soon as scheduling returns:

* every tensor is copied into one shared-memory segment per bucket
  (:mod:`megatron_async.core.shared_memory`), CPU tensors included: ``tensor.to("cpu")``
  would return the very same tensor, and an in-place update after scheduling would leak
  into the file. Shared memory is what lets a forked writer read the buffers without
  write-protecting them, and the persistent worker map them once instead of receiving
  every tensor;
* with CUDA tensors the segment is also page-locked (``cudaHostRegister``), so their
  copies are non-blocking, followed by one bounded wait for them
  (:mod:`megatron_async.core.device_wait`).

No CUDA API is called unless a tensor is on a CUDA device.

The staged buckets (:class:`StagedBuckets`) hold their buffers until the caller releases
them (the write finished, failed, or its process is gone). With a *cache key*
(``use_cached_data_structure``), a layout's buffers are kept after release
(:class:`~.budget.StagingBufferCache`) and reused by its next save, so staging memory
stays about the checkpoint size and warm staging is one memory copy; a save that finds
them still lent (a save still being written) uses fresh buffers.

A warm save runs no Python bytecode per tensor: a cached bucket of contiguous CPU
tensors is copied with one ``torch.cat`` into its segment (:mod:`.flat_copy`), checked
with a few ``map`` calls; other buckets (CUDA sources among them) with one batched call
(:func:`copy_batched`) after one list comparison of the sources against the buffers. The
``(item, buffer)`` pairs of a cached bucket are built once and handed to every save with
the same plan items (a :class:`~megatron_async.core.shared_memory.ReusedTensorPairs`,
which the persistent worker's request sender encodes once).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from typing import FrozenSet, Hashable, List, Optional, Sequence, Set, Tuple

import torch
from torch.distributed.checkpoint.planner import WriteItem

from megatron_async.buckets.layout import ResolvedPlanData, WriteBucket, unpack_resolved_plan_data
from megatron_async.core import shared_memory
from megatron_async.core.device_wait import (
    DeviceCopyTimeoutError,
    landed_after_failure,
    wait_for_device_copies,
)
from megatron_async.core.gc_pause import paused_gc
from megatron_async.core.shared_memory import ReusedTensorPairs
from megatron_async.staging.budget import StagingBufferCache
from megatron_async.staging.overlapped import CopyJob, StagedData, watch
from megatron_async.staging.flat_copy import FlatCopy, copy_threads
from megatron_async.staging.gate import StagingGate

__all__ = ["StagedBuckets", "stage_buckets", "preload_tensors", "copy_batched"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _BucketBuffers:
    """The host buffers of one bucket: exact-size views of one shared segment."""

    segment: Optional[torch.Tensor]
    tensors: List[torch.Tensor]
    for_cuda: bool = False
    """Allocated for CUDA sources: the segment was page-locked (if CUDA allowed it)."""
    reusable: bool = False
    """Kept in a :class:`StagingBufferCache` for the next saves of the same layout."""
    signature: Optional[List[tuple]] = None
    """``(shape, dtype, device)`` of the sources last found to fit, so that a save of the
    same sources checks them with one comparison."""
    cuda_devices: FrozenSet[torch.device] = frozenset()
    """The CUDA devices among those sources (to wait for after the copies)."""
    pairs: Optional[ReusedTensorPairs] = None
    """``(item, buffer)`` pairs handed to every save whose items are these (reusable only)."""
    flat: Optional[FlatCopy] = None
    """The one-call copy of CPU sources into these buffers (cached buffers only)."""
    flat_off: bool = False
    """No one-call copy is tried any more (see :meth:`copy_flat`)."""

    def fits(self, sources: Sequence[torch.Tensor]) -> bool:
        signature = [(source.shape, source.dtype, source.device) for source in sources]
        if signature == self.signature:
            return True
        devices = {device for _, _, device in signature if device.type == "cuda"}
        if devices and not self.for_cuda:
            return False
        if len(sources) != len(self.tensors) or not all(
            buffer.shape == source.shape and buffer.dtype == source.dtype
            for buffer, source in zip(self.tensors, sources)
        ):
            return False
        self.signature, self.cuda_devices = signature, frozenset(devices)
        return True

    def pairs_for(self, items: List[WriteItem]) -> List[Tuple[WriteItem, torch.Tensor]]:
        """The staged ``(item, buffer)`` pairs of ``items``: the same object while the items
        are the same objects (a cached plan), so the request sender encodes it once."""
        if not self.reusable:
            return list(zip(items, self.tensors))
        pairs = self.pairs
        if pairs is None or len(pairs) != len(items) or not all(
            map(operator.is_, items, map(operator.itemgetter(0), pairs))
        ):
            pairs = self.pairs = ReusedTensorPairs(zip(items, self.tensors))
        return pairs

    def num_bytes(self) -> int:
        return self.segment.numel() if self.segment is not None else 0

    def copy_flat(self, sources: List[torch.Tensor], build: bool = False) -> bool:
        """Copy the sources with one ``torch.cat`` if possible; return whether it did (stager).

        ``build``: the sources fit these buffers (shapes and dtypes), so a cached bucket of
        CPU sources may plan a new one-call copy when the current one does not apply. It
        stops trying once a rebuilt copy did not serve a single later save: sources in new
        memory at every save would pay for the views every time (the caller then copies
        with ``torch._foreach_copy_``).
        """
        flat = self.flat
        if flat is not None and flat.matches(sources):
            flat.hits += 1
            flat.copy()
            return True
        if not build or self.flat_off or not self.reusable or self.for_cuda or self.cuda_devices:
            return False
        if flat is not None and not flat.hits:
            self.flat, self.flat_off = None, True
            return False
        flat = self.flat = FlatCopy.build(sources, self.tensors, self.segment, copy_threads())
        if flat is None:  # a source that is not a contiguous CPU tensor
            self.flat_off = True
            return False
        flat.copy()
        return True


def _allocate_bucket_buffers(
    sources: Sequence[torch.Tensor], non_blocking: bool, reusable: bool
) -> _BucketBuffers:
    """Allocate one bucket's host buffers in one shared segment, pinned for CUDA sources."""
    offsets: List[Optional[int]] = []
    total = 0
    for source in sources:
        if source.numel():
            start = shared_memory.aligned(total)
            offsets.append(start)
            total = start + source.numel() * source.element_size()
        else:
            offsets.append(None)
    segment = shared_memory.allocate_segment(total, reusable) if total else None
    for_cuda = non_blocking and any(s.device.type == "cuda" for s in sources)
    if segment is not None and for_cuda:
        # Like DCP's shared + pinned staging: register the shared pages with CUDA, so
        # device-to-host copies run asynchronously and the worker still maps the segment.
        shared_memory.pin_segment(segment)
    tensors = [
        shared_memory.segment_view(segment, start, tuple(source.shape), source.dtype)
        if start is not None
        else torch.empty(source.shape, dtype=source.dtype)
        for source, start in zip(sources, offsets)
    ]
    return _BucketBuffers(segment, tensors, for_cuda, reusable)


class StagedBuckets(StagedData, list):
    """Staged write buckets; with a cache key, the borrower of the cached buffers they live
    in (under their ``loan``: :class:`~.budget.Loan`).

    With overlapped staging or in rounds, the copies made after the hand-over
    (:class:`~.overlapped.StagedData`). Pickled (to the persistent worker), only the
    buckets travel: ``release`` is the stager's to call.
    """

    def __init__(self, buckets=()):
        super().__init__(buckets)
        self._fresh: List[_BucketBuffers] = []  # buffers of this save only

    def __reduce__(self):
        return (StagedBuckets, (list(self),))


@paused_gc()  # lists of thousands of tensors and pairs per save; no cycles
def stage_buckets(
    buckets: Sequence[WriteBucket],
    non_blocking: bool = True,
    cache_key: Optional[Hashable] = None,
    cache: Optional[StagingBufferCache] = None,
    copy_later: Optional[StagingGate] = None,
) -> StagedBuckets:
    """Copy every tensor of ``buckets`` into host memory and return the staged buckets.

    Runs in the trainer (the request's ``preload_fn``).

    Args:
        buckets: planned buckets whose tensors may live anywhere (CPU or CUDA).
        non_blocking: use pinned buffers and asynchronous copies for CUDA tensors
            (followed by one bounded wait).
        cache_key: the bucket layout's key; when given, reuse the cached buffers of
            that layout instead of allocating new ones.
        cache: where buffers are cached; :meth:`StagingBufferCache.of_process` when None.
        copy_later: the save's gate, for overlapped staging: only borrow the buffers; the
            result's ``copy_job`` copies every tensor on the copy thread after the
            hand-over (:class:`~.overlapped.StagedData`), marking each copied on that gate.

    Returns:
        Buckets with the same items whose tensors are contiguous host copies; call
        :meth:`StagedBuckets.release` once the background part is done with them.

    Raises:
        StagingMemoryError: shared memory for the buffers could not be allocated.
    """
    start = time.monotonic()
    cache = cache if cache is not None else StagingBufferCache.of_process()
    result = StagedBuckets()
    cached = None
    if cache_key is not None:
        cached, result.loan = cache.lend(cache_key, len(buckets))
    cuda_devices: Set[torch.device] = set()
    late_copies: List[tuple] = []  # (name, source, buffer, watched) for the copy job (copy_later)
    allocated = 0
    try:
        for b_idx, bucket in enumerate(buckets):
            bytes_data, tensor_data = bucket.data
            items = list(map(_first, tensor_data))
            sources = list(map(_second, tensor_data))
            buffers = cached[b_idx] if cached is not None else None
            copied = copy_later is None and buffers is not None and buffers.copy_flat(sources)
            if not copied and (buffers is None or not buffers.fits(sources)):
                buffers = _allocate_bucket_buffers(sources, non_blocking, reusable=cached is not None)
                buffers.fits(sources)  # records the sources' signature
                allocated += 1
                if cached is not None:
                    cached[b_idx] = buffers
                else:
                    result._fresh.append(buffers)
            if copy_later is not None:
                for item, source, buffer in zip(items, sources, buffers.tensors):
                    source = source.detach()
                    late_copies.append((item.index.fqn, source, buffer, watch(source)))
            elif not copied and not buffers.copy_flat(sources, build=True):
                cuda_devices.update(buffers.cuda_devices)  # before: a failing copy may queue some
                copy_batched(buffers.tensors, sources, non_blocking and bool(buffers.cuda_devices))
            copies = buffers.pairs_for(items)
            result.append(WriteBucket(bucket.file_path, bucket.file_name, (bytes_data, copies)))
        wait_for_device_copies(cuda_devices, holding=(result, cached))
        cuda_devices.clear()
    except BaseException as exc:
        device_stuck = isinstance(exc, DeviceCopyTimeoutError) or bool(cuda_devices) and not (
            landed_after_failure(cuda_devices, holding=(result, cached)))  # queued before it
        if device_stuck or cached is not None and any(
                b is not None and b.flat is not None and b.flat.stuck for b in cached):
            cache.forget(result.loan)  # a stuck copy may still write into them
        result.release()
        raise
    if logger.isEnabledFor(logging.DEBUG):
        copied = sum(t.numel() * t.element_size() for b in result for _, t in b.data[1])
        logger.debug(
            "staged %d bytes in %d buckets in %.3fs (%d of them into new buffers)",
            copied, len(result), time.monotonic() - start, allocated,
        )
    if copy_later is not None:
        copy_later.start_rounds()  # the writer waits for each item's copied mark
        result.copy_job = CopyJob(copy_later, late_copies, list(range(len(late_copies))),
                                  waits_for=[()] * len(late_copies))
    return result


_first = operator.itemgetter(0)
_second = operator.itemgetter(1)


def copy_batched(buffers: List[torch.Tensor], sources: List[torch.Tensor], non_blocking: bool) -> None:
    """Copy every source into its buffer of the same shape and dtype, in one call (stager).

    One ``torch._foreach_copy_`` over the two lists instead of one Python call per tensor
    (thousands per save). Sources may require grad: the copy is not recorded.
    """
    if sources:
        with torch.no_grad():
            torch._foreach_copy_(buffers, sources, non_blocking=non_blocking)


def preload_tensors(
    resolved_plan_data: ResolvedPlanData,
    non_blocking: bool = True,
    *,
    staging_cache: Optional[StagingBufferCache] = None,
) -> List[WriteBucket]:
    """Stage the prepared buckets' tensors to host memory: a snapshot (trainer, every rank).

    The reference API's ``FileSystemWriterAsync.preload_tensors``. CUDA tensors go to
    pinned buffers (non-blocking copies, one bounded wait); CPU tensors are copied as
    well, so later in-place updates never reach the file.

    Args:
        resolved_plan_data: ``(checkpoint_dir, (identifier, write_buckets))`` as
            ``prepare_write_data`` left it in the writer's ``resolved_plan_data``. With a
            :class:`~megatron_async.buckets.layout.ConsistentDataIdentifier`, the buffers
            staged under that key by an earlier save are reused
            (``use_cached_data_structure``); None stages into fresh buffers.
        non_blocking: pinned buffers and asynchronous copies for CUDA tensors.
        staging_cache: where the reusable buffers live (the trainer's);
            :meth:`StagingBufferCache.of_process` when None.

    Returns:
        The staged buckets (a :class:`~megatron_async.staging.buffers.StagedBuckets`).
    """
    identifier, write_buckets = unpack_resolved_plan_data(resolved_plan_data)
    key = identifier.key if identifier is not None else None
    return stage_buckets(write_buckets, non_blocking, key, staging_cache)
