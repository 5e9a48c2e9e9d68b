"""The physical limits a checkpoint save is measured against (a rank job).

* Memory copy bandwidth: ``dst.copy_(src)`` into a preallocated, already touched buffer,
  the operation staging performs. Measured on rank 0 alone and on every rank at once
  (a save stages on every rank at the same time, so that is the relevant limit per rank).
  With CUDA, staging copies device to host instead, so the device-to-pinned-host copy
  bandwidth (every rank at once) is measured too and is the staging limit there.
* Sequential write + fsync bandwidth of the checkpoint filesystem: incompressible bytes
  written in large chunks from a preallocated buffer, then ``fsync``. Measured with one
  writer, and with one writer per rank at once (aggregate bytes over the wall time).

Each measurement is the best of a few repetitions, and runs in its own spawned ranks so
that no other benchmark state is resident.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from .launch import RankContext

__all__ = ["limits_job"]

_CHUNK_BYTES = 16 * 2**20
_COPY_REPEATS = 5
_DISK_REPEATS = 2


def _copy_seconds(dst: torch.Tensor, src: torch.Tensor) -> float:
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def _device_to_host_bytes_per_s(src: torch.Tensor, group) -> float:
    """Slowest rank's device-to-pinned-host copy bandwidth, every rank copying at once."""
    device_src = src.to(torch.cuda.current_device())
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    pinned.copy_(device_src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(_COPY_REPEATS):
        dist.barrier(group=group)
        start = time.perf_counter()
        pinned.copy_(device_src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    per_rank = _gather_floats([src.numel() / best], group)
    return min(v[0] for v in per_rank)


def _write_file(path: str, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset in range(0, len(data), _CHUNK_BYTES):
            os.write(fd, data[offset : offset + _CHUNK_BYTES])
        os.fsync(fd)
    finally:
        os.close(fd)


def _gather_floats(values: List[float], group) -> List[List[float]]:
    gathered: List = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, values, group=group)
    return gathered


def limits_job(ctx: RankContext) -> Dict[str, float]:
    """Measure memcpy and write + fsync bandwidth (every rank); rank 0 returns the results.

    Payload: ``num_bytes`` (per rank) and ``directory`` (on the filesystem to measure).
    """
    num_bytes = int(ctx.payload["num_bytes"])
    directory = os.path.join(ctx.payload["directory"], "_limits_probe")
    group = dist.new_group(backend="gloo")
    rank = ctx.rank

    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page: measure copying, not page faults

    result: Dict[str, float] = {"num_bytes_per_rank": float(num_bytes)}
    dist.barrier(group=group)
    if rank == 0:
        best = min(_copy_seconds(dst, src) for _ in range(_COPY_REPEATS))
        result["memcpy_single_bytes_per_s"] = num_bytes / best
    dist.barrier(group=group)
    best_all = float("inf")
    for _ in range(_COPY_REPEATS):
        dist.barrier(group=group)
        best_all = min(best_all, _copy_seconds(dst, src))
    per_rank = _gather_floats([num_bytes / best_all], group)
    # A save is as slow as its slowest rank: the limit is the slowest rank's bandwidth.
    result["memcpy_concurrent_bytes_per_s"] = min(v[0] for v in per_rank)
    del dst
    if torch.cuda.is_available():
        result["d2h_concurrent_bytes_per_s"] = _device_to_host_bytes_per_s(src, group)

    if rank == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier(group=group)
    data = memoryview(src.numpy())
    path = os.path.join(directory, f"probe_rank{rank}.bin")
    if rank == 0:
        best = float("inf")
        for _ in range(_DISK_REPEATS):
            start = time.perf_counter()
            _write_file(path, data)
            best = min(best, time.perf_counter() - start)
            os.remove(path)
        result["disk_single_bytes_per_s"] = num_bytes / best
    best_span = float("inf")
    for _ in range(_DISK_REPEATS):
        dist.barrier(group=group)
        start = time.monotonic()
        _write_file(path, data)
        end = time.monotonic()
        spans = _gather_floats([start, end], group)
        best_span = min(best_span, max(s[1] for s in spans) - min(s[0] for s in spans))
        os.remove(path)
    result["disk_concurrent_bytes_per_s"] = num_bytes * ctx.world_size / best_span
    result["disk_concurrent_writers"] = float(ctx.world_size)
    dist.barrier(group=group)
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return result if rank == 0 else {}
