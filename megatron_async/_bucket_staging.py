"""Host staging of write buckets: a real snapshot of every tensor, optionally in reused buffers.

Staging runs wherever the request's preload function runs: in the trainer right before a
forked writer starts, in the persistent worker, or in the calling thread of a synchronous
save. It copies every tensor into a host buffer, so the trainer may update its tensors in
place as soon as scheduling returns:

* CUDA tensors go to pinned host buffers with non-blocking copies and one synchronize;
* CPU tensors are copied too (``tensor.to("cpu")`` would return the very same tensor,
  and an in-place update after scheduling would leak into the file).

No CUDA API is called unless a tensor is on a CUDA device.

With a *cache key* (``use_cached_data_structure``), the buffers of a given bucket layout
are kept in this process and reused by the next save of the same layout, so staging memory
stays about the checkpoint size instead of growing with every save. A buffer set is
*leased* from staging until the data in it is safe from the next staging:

* the write finished in this process (synchronous save, persistent worker), or
* the thread that staged forked the process before writing started here: the forked
  writer then owns a copy-on-write snapshot (the temporal caller).

A staging that finds its buffers still leased (a pipelined caller) allocates fresh ones.
Every lease has its own generation number, carried by the staged buckets
(:class:`StagedBuckets`): only the save that holds the current lease may mark or free the
buffers, so a save that wrote from fresh buffers can never free buffers that a later save
has just staged into.

Buffers filled by device-to-host copies (CUDA sources) are not freed at fork: a GPU copy
into pinned memory need not trigger the copy-on-write that protects the forked writer's
snapshot, so such buffers stay leased and the next save allocates fresh ones.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from typing import Hashable, List, Optional, Sequence, Tuple

import torch

from megatron_async._write_buckets import WriteBucket
from megatron_async.staging import copy_tensor_to_host, synchronize_if_cuda

__all__ = [
    "StagedBuckets",
    "stage_buckets",
    "release_staging_buffers",
    "mark_staging_buffers_writing",
    "staging_cache_num_bytes",
    "clear_staging_cache",
]

logger = logging.getLogger(__name__)

MAX_CACHED_LAYOUTS = 4
"""How many distinct bucket layouts keep their buffers in one process (least recent dropped)."""

_FREE, _STAGED, _WRITING = "free", "staged", "writing"


@dataclasses.dataclass
class _BufferSet:
    buffers: List[List[Optional[torch.Tensor]]]
    state: str = _FREE
    owner_pid: int = 0
    owner_thread: int = 0
    generation: int = 0
    device_copied: bool = False

    def num_bytes(self) -> int:
        return sum(
            b.numel() * b.element_size() for bucket in self.buffers for b in bucket if b is not None
        )


_lock = threading.Lock()
_cache: "collections.OrderedDict[Hashable, _BufferSet]" = collections.OrderedDict()


def _release_staged_after_fork() -> None:
    """In the parent after a fork by the staging thread: the child owns the staged snapshot."""
    for entry in list(_cache.values()):
        if (
            entry.state == _STAGED
            and not entry.device_copied
            and entry.owner_pid == os.getpid()
            and entry.owner_thread == threading.get_ident()
        ):
            entry.state = _FREE


os.register_at_fork(after_in_parent=_release_staged_after_fork)


def _fits(buffer: torch.Tensor, tensor: torch.Tensor) -> bool:
    return buffer.shape == tensor.shape and buffer.dtype == tensor.dtype


class StagedBuckets(list):
    """Staged write buckets, plus the lease of the cached buffers they live in (if any).

    ``lease`` is ``(cache_key, generation)`` when the buckets use this process's cached
    buffers, else None (fresh buffers that nobody else can reuse).
    """

    lease: Optional[Tuple[Hashable, int]] = None

    def __reduce__(self):
        return (_rebuild_staged, (list(self), self.lease))


def _rebuild_staged(items, lease):
    staged = StagedBuckets(items)
    staged.lease = lease
    return staged


def _lease(key: Hashable, buckets: Sequence[WriteBucket]) -> Optional[_BufferSet]:
    """Return this layout's free buffer set, leased to the caller, or None if none is free."""
    with _lock:
        entry = _cache.get(key)
        if entry is None:
            entry = _BufferSet([[None] * len(b.data[1]) for b in buckets])
            _cache[key] = entry
            while len(_cache) > MAX_CACHED_LAYOUTS:
                oldest = next(iter(_cache))
                if _cache[oldest].state != _FREE:
                    break
                del _cache[oldest]
        elif entry.state != _FREE:
            logger.debug("staging buffers of this layout are still in use; allocating new ones")
            return None
        _cache.move_to_end(key)
        entry.state, entry.owner_pid, entry.owner_thread = _STAGED, os.getpid(), threading.get_ident()
        entry.generation += 1
        entry.device_copied = False
        return entry


def stage_buckets(
    buckets: Sequence[WriteBucket], non_blocking: bool = True, cache_key: Optional[Hashable] = None
) -> List[WriteBucket]:
    """Copy every tensor of ``buckets`` into host memory and return the staged buckets.

    Runs where the preload function runs (trainer or persistent worker).

    Args:
        buckets: planned buckets whose tensors may live anywhere (CPU or CUDA).
        non_blocking: use pinned buffers and asynchronous copies for CUDA tensors
            (followed by one synchronize).
        cache_key: the bucket layout's key; when given, reuse this process's buffers
            of that layout instead of allocating new ones.

    Returns:
        Buckets with the same items whose tensors are contiguous host copies, with the
        lease of the cached buffers they use (see :class:`StagedBuckets`).
    """
    entry = _lease(cache_key, buckets) if cache_key is not None else None
    lease = (cache_key, entry.generation) if entry is not None else None
    cuda_sources: List[torch.Tensor] = []
    staged: List[WriteBucket] = []
    try:
        for b_idx, bucket in enumerate(buckets):
            bytes_data, tensor_data = bucket.data
            copies: List[Tuple[object, torch.Tensor]] = []
            for t_idx, (item, tensor) in enumerate(tensor_data):
                if tensor.device.type == "cuda":
                    cuda_sources.append(tensor)
                buffer = entry.buffers[b_idx][t_idx] if entry is not None else None
                if buffer is not None and _fits(buffer, tensor):
                    buffer.copy_(tensor.detach(), non_blocking=non_blocking)
                else:
                    buffer = copy_tensor_to_host(tensor, non_blocking)
                    if entry is not None:
                        entry.buffers[b_idx][t_idx] = buffer
                copies.append((item, buffer))
            staged.append(WriteBucket(bucket.file_path, bucket.file_name, (bytes_data, copies)))
        if entry is not None and cuda_sources:
            entry.device_copied = True
        synchronize_if_cuda(cuda_sources)
    except BaseException:
        release_staging_buffers(lease)
        raise
    result = StagedBuckets(staged)
    result.lease = lease
    return result


def _current_entry(lease: Optional[Tuple[Hashable, int]]) -> Optional[_BufferSet]:
    """The cached buffer set ``lease`` still holds in this process, else None (under _lock)."""
    if lease is None:
        return None
    cache_key, generation = lease
    entry = _cache.get(cache_key)
    if entry is None or entry.generation != generation or entry.owner_pid != os.getpid():
        return None
    return entry


def mark_staging_buffers_writing(lease: Optional[Tuple[Hashable, int]]) -> None:
    """Record that this process now writes from the leased buffers (background writer)."""
    with _lock:
        entry = _current_entry(lease)
        if entry is not None and entry.state == _STAGED:
            entry.state = _WRITING


def release_staging_buffers(lease: Optional[Tuple[Hashable, int]]) -> None:
    """Make the leased buffers reusable once this process is done writing them.

    A lease that is no longer current (its buffers were freed and leased again by a later
    save) releases nothing.
    """
    with _lock:
        entry = _current_entry(lease)
        if entry is not None:
            entry.state = _FREE


def staging_cache_num_bytes() -> int:
    """Bytes held by this process's cached staging buffers."""
    with _lock:
        return sum(entry.num_bytes() for entry in _cache.values())


def clear_staging_cache(include_in_use: bool = False) -> None:
    """Drop this process's cached staging buffers that are not in use (or all of them).

    ``include_in_use`` also forgets leased buffers (whose data stays valid for whoever
    holds it); use it only when no save of this process is in flight, e.g. in tests.
    """
    with _lock:
        for key in [k for k, e in _cache.items() if include_in_use or e.state == _FREE]:
            del _cache[key]
