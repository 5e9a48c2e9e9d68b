"""The trainer's tensor pages that a forked worker gives up (trainer side, and the child's).

Before forking the persistent worker (:mod:`megatron_async.core.worker_fork`), the
trainer lists the page-aligned insides of its private CPU tensor storages
(:func:`trainer_tensor_pages`); the child drops its share of them at once
(:func:`release_inherited_pages`, ``MADV_DONTNEED``), so that the trainer's in-place
updates of parameters and optimizer state neither copy pages nor leave the old ones
pinned in the worker.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import mmap
from typing import Any, List, Sequence, Tuple

import torch

__all__ = [
    "MIN_RELEASED_STORAGE_BYTES",
    "PageRange",
    "libc_madvise",
    "release_inherited_pages",
    "trainer_tensor_pages",
]

MIN_RELEASED_STORAGE_BYTES = 1 << 20
"""Tensor storages at least this large have their pages released in the forked worker;
smaller ones share at most a few pages each with the trainer."""

_MADV_DONTNEED = 4

PageRange = Tuple[int, int]
"""``(start address, length)``, both multiples of the page size."""


_madvise_fn: Any = None


def libc_madvise():
    """libc's ``madvise``, resolved in the trainer and passed to the child."""
    global _madvise_fn
    if _madvise_fn is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            _madvise_fn = False
        else:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise_fn = fn
    return _madvise_fn or None


def _private_anonymous_mappings() -> List[PageRange]:
    """This process's private, writable, anonymous mappings (heap included), sorted."""
    mappings: List[PageRange] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            perms, inode = fields[1], fields[4]
            path = fields[5] if len(fields) > 5 else ""
            if "w" in perms and perms.endswith("p") and inode == "0" and path in ("", "[heap]"):
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                mappings.append((start, end - start))
    return sorted(mappings)


def _clip(ranges: List[PageRange], mappings: List[PageRange]) -> List[PageRange]:
    """The parts of ``ranges`` that lie inside ``mappings`` (both sorted by start)."""
    clipped: List[PageRange] = []
    index = 0
    for start, length in sorted(ranges):
        end = start + length
        while index < len(mappings) and sum(mappings[index]) <= start:
            index += 1
        probe = index
        while probe < len(mappings) and mappings[probe][0] < end:
            low = max(start, mappings[probe][0])
            high = min(end, sum(mappings[probe]))
            if high > low:
                clipped.append((low, high - low))
            probe += 1
    return clipped


def trainer_tensor_pages(
    min_bytes: int = MIN_RELEASED_STORAGE_BYTES,
) -> Tuple[List[PageRange], List[torch.UntypedStorage]]:
    """The whole pages inside every live private CPU tensor storage of ``min_bytes`` or more.

    Runs on the trainer, just before the fork. Returns the ranges and the storages they
    belong to: keep the storages referenced until the child exists, so that no range is
    freed and reused by other data in between. Only whole pages are listed (the partial
    pages at either end may hold other allocations, or the allocator's bookkeeping,
    which the child may still touch), and only inside private anonymous mappings.
    Shared-memory storages are skipped (a fork shares them without copy-on-write).
    """
    page = mmap.PAGESIZE
    seen = set()
    ranges: List[PageRange] = []
    storages: List[torch.UntypedStorage] = []
    objects = gc.get_objects()
    # Filter by type first (hundreds of thousands of objects: this is the scan's cost),
    # with map/compress so that the loop over every object runs in C, not in bytecode
    # (a list comprehension took 60 of the scan's 130 ms in the GPT example).
    # type(), not isinstance(): the latter reads ``__class__``, which some deprecated
    # module attributes turn into a warning.
    kinds = list(map(type, objects))
    tensor_types = {t for t in set(kinds) if issubclass(t, torch.Tensor)}
    tensors = list(itertools.compress(objects, map(tensor_types.__contains__, kinds)))
    del objects, kinds
    for obj in tensors:
        try:
            if obj.layout is not torch.strided:
                continue
            storage = obj.untyped_storage()
            if storage.device.type != "cpu":
                continue
            address, size = storage.data_ptr(), storage.nbytes()
            if address == 0 or size < min_bytes or address in seen or storage.is_shared():
                continue
        except Exception:  # tensor subclasses without a storage (wrappers, fake tensors)
            continue
        seen.add(address)
        start = -(-address // page) * page
        end = (address + size) // page * page
        if end > start:
            ranges.append((start, end - start))
            storages.append(storage)
    if not ranges:
        return [], storages
    try:
        mappings = _private_anonymous_mappings()
    except OSError:  # no /proc: release nothing rather than guess
        return [], storages
    return _clip(ranges, mappings), storages


def release_inherited_pages(ranges: Sequence[PageRange], madvise) -> int:
    """Drop this (forked) process's share of ``ranges``; return the bytes released (worker side).

    After ``MADV_DONTNEED`` the pages read as zeros here, and the trainer owns its copies
    alone: its next write to each reuses the page instead of copying it.
    """
    released = 0
    for start, length in ranges:
        if madvise(start, length, _MADV_DONTNEED) == 0:
            released += length
    return released
