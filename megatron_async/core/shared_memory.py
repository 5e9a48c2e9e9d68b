"""Shared-memory segments: host staging memory that a background process maps as well.

Runs in the trainer. Staging buffers live in *segments*: one-dimensional ``uint8``
tensors in POSIX shared memory, each with a process-unique id. A forked writer (temporal
caller) reads a segment through a shared mapping, so the fork write-protects nothing and
the next staging into a reused buffer takes no copy-on-write fault per page; the
persistent worker maps a segment once and then receives tensors in it by reference
(:mod:`megatron_async.core.request_transport`).

A segment stays registered while the tensor returned by :func:`allocate_segment` is
alive; ids are never reused, so a stale id can never name other memory. Every segment is
reserved with ``posix_fallocate`` (:func:`_reserve`), so a full ``/dev/shm`` is a
:class:`StagingMemoryError` at allocation, never a SIGBUS later.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import os
import threading
import weakref
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from megatron_async.errors import StagingMemoryError

__all__ = [
    "ALIGNMENT",
    "aligned",
    "Segment",
    "allocate_segment",
    "pin_segment",
    "segment_view",
    "find_segment",
    "segment_ranges",
    "ReusedTensorPairs",
    "live_bytes",
]

logger = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"

ALIGNMENT = 64
"""Byte alignment of each tensor placed in a segment (a cache line; a multiple of any
dtype's element size, so every placed tensor can be viewed in its own dtype)."""


def aligned(offset: int) -> int:
    """The first :data:`ALIGNMENT` boundary at or after ``offset`` (where the next tensor goes)."""
    return -(-offset // ALIGNMENT) * ALIGNMENT


class Segment(NamedTuple):
    """Where a tensor lives in a registered segment."""

    segment_id: int
    tensor: torch.Tensor
    """The ``uint8`` tensor that owns the segment's memory."""
    byte_offset: int
    """Offset of the tensor's first byte in the segment."""
    reusable: bool
    """The segment serves save after save (cached staging buffers); otherwise one call."""


# A per-process fact with no owner: which addresses of this process's memory lie in a
# segment, whoever allocated it (any stager, the request arena); the sender looks any
# tensor up here.
_lock = threading.Lock()
_ids = itertools.count(1)
_bases: List[int] = []  # sorted start addresses of the live segments
_by_base: Dict[int, Tuple[int, "weakref.ref[torch.Tensor]", int, bool]] = {}  # id, owner, size, reusable


def _unregister(base: int, segment_id: int) -> None:
    with _lock:
        entry = _by_base.get(base)
        if entry is not None and entry[0] == segment_id:
            del _by_base[base]
            del _bases[bisect.bisect_left(_bases, base)]


def _reserve(storage: torch.UntypedStorage, num_bytes: int) -> None:
    """Make tmpfs commit the pages now, so that a full ``/dev/shm`` fails here, not with SIGBUS."""
    fd, _size = storage._share_fd_cpu_()
    os.posix_fallocate(fd, 0, num_bytes)


def allocate_segment(num_bytes: int, reusable: bool = False) -> torch.Tensor:
    """Allocate ``num_bytes`` of shared memory as a registered ``uint8`` tensor (trainer).

    ``reusable`` marks buffers kept for later saves: a persistent worker keeps such a
    segment mapped, and drops any other after the call that used it.

    Raises:
        StagingMemoryError: shared memory is exhausted (``/dev/shm`` too small).
    """
    num_bytes = max(int(num_bytes), 1)
    try:
        # Always descriptor-backed, whatever torch's sharing strategy: the descriptor is
        # what reserves the pages and what the persistent worker receives.
        storage = torch.UntypedStorage._new_using_fd_cpu(num_bytes)
        _reserve(storage, num_bytes)
    except (OSError, RuntimeError) as exc:
        free = "unknown"
        try:
            stats = os.statvfs(_SHM_DIR)
            free = f"{stats.f_bavail * stats.f_frsize / 2**20:.0f} MiB"
        except OSError:
            pass
        raise StagingMemoryError(
            f"cannot allocate {num_bytes / 2**20:.1f} MiB of shared memory for checkpoint "
            f"staging ({exc}); {_SHM_DIR} has {free} free. Give the job more shared memory "
            "(e.g. docker --shm-size), or save fewer bytes per rank at once"
        ) from exc
    tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
    base = tensor.data_ptr()
    with _lock:
        segment_id = next(_ids)
        _by_base[base] = (segment_id, weakref.ref(tensor), num_bytes, reusable)
        bisect.insort(_bases, base)
    weakref.finalize(tensor, _unregister, base, segment_id)
    return tensor


def pin_segment(segment: torch.Tensor) -> bool:
    """Page-lock a segment for fast asynchronous device-to-host copies (trainer, CUDA only).

    The registration ends with the segment. Returns False, after logging why, when CUDA
    refuses (copies into the segment then still work, synchronously).
    """
    try:
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.pin_memory(segment.data_ptr(), segment.numel())
    except Exception as exc:  # a slower copy, never a failed save
        logger.warning("cannot pin the staging segment (%s); device copies run synchronously", exc)
        return False
    weakref.finalize(segment, _unpin, segment.data_ptr())
    return True


def _unpin(pointer: int) -> None:
    try:
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.unpin_memory(pointer)
    except Exception as exc:  # at interpreter exit CUDA may be torn down already
        logger.debug("unpinning a staging segment failed: %s", exc)


def segment_view(segment: torch.Tensor, byte_offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor over ``segment``'s bytes from ``byte_offset``, with a storage of its own.

    Runs wherever a segment is mapped. The view's storage spans exactly its own bytes
    (and keeps the segment alive): ``torch.save``, which DCP uses for every item, writes
    a tensor's whole storage, so a plain slice of the segment would write the segment.
    """
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    window = segment.numpy()[byte_offset : byte_offset + num_bytes]
    return torch.frombuffer(window, dtype=dtype).view(shape)


def find_segment(tensor: torch.Tensor) -> Optional[Segment]:
    """Return the registered segment holding all of ``tensor``'s (contiguous) data, or None."""
    if (
        tensor.device.type != "cpu"
        or tensor.layout is not torch.strided
        or not tensor.is_contiguous()
        or tensor.numel() == 0
    ):
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _lock:
        idx = bisect.bisect_right(_bases, start) - 1
        if idx < 0:
            return None
        base = _bases[idx]
        segment_id, owner_ref, size, reusable = _by_base[base]
    if end > base + size:
        return None
    owner = owner_ref()
    # Only a live owner proves the address range still is the registered memory.
    if owner is None or owner.data_ptr() != base:
        return None
    return Segment(segment_id, owner, start - base, reusable)


def segment_ranges() -> List[Tuple[int, int]]:
    """``(start address, bytes)`` of every registered segment.

    Reads without the lock: the forked persistent worker calls it first thing, where a
    thread that no longer exists may have held the lock at the fork (and no other thread
    runs there to change the table).
    """
    return [(base, entry[2]) for base, entry in list(_by_base.items())]


def live_bytes() -> int:
    """Bytes of shared memory this process's registered segments hold (staging included)."""
    with _lock:
        return sum(entry[2] for entry in _by_base.values())


class ReusedTensorPairs(list):
    """``(write item, staged tensor)`` pairs that recur unchanged from save to save (trainer).

    The stager builds one per bucket of a reused staging-buffer set and hands the very
    same object to every save of that structure (the items are the cached plan's, the
    tensors views of reusable segments whose contents each save overwrites), so the
    request sender sends it once per worker (which keeps its decoded copy). Never mutate
    one after it was handed out: make a new one instead.
    """

    __slots__ = ("__weakref__",)
