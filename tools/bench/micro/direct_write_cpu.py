"""Micro-benchmark: the CPU one bucket's direct-I/O write costs the background writer.

Writes ``--mib`` MiB of float32 tensors (1 MiB each, every third one a few bytes longer,
so items straddle block edges) as one bucket file through the direct-I/O writer
(:class:`~megatron_async.buckets.direct_io.LocalBucketFile`, hashing on), as the
background writer does, ``--reps`` times, and prints the median user and system CPU
seconds and wall time of a write. ``--source shared`` places the tensors in a
shared-memory segment as staging does (what the worker reads); ``private`` in the
process's own memory. Each file is checked (digests and ``torch.load`` of every item)
before it is removed::

    python -m tools.bench.micro.direct_write_cpu --dir /tmp/dwc --source shared

Run it on a quiet machine, before and after a change to the writer. Tooling only: it
prints, and never changes the library.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import statistics
import time

import torch
import xxhash

from megatron_async.core import shared_memory
from megatron_async.buckets.direct_io import LocalBucketFile
from megatron_async.writer.tensor_archive import tensor_bytes, tensor_frame

_ELEMENTS = 256 * 1024  # 1 MiB of float32


def _tensors(mib: int, source: str):
    sizes = [_ELEMENTS + (7 if i % 3 == 0 else 0) for i in range(mib)]
    if source == "private":
        return [torch.randn(n) for n in sizes]
    offsets, total = [], 0
    for n in sizes:
        start = shared_memory.aligned(total)
        offsets.append(start)
        total = start + 4 * n
    segment = shared_memory.allocate_segment(total)
    tensors = [shared_memory.segment_view(segment, o, (n,), torch.float32)
               for o, n in zip(offsets, sizes)]
    for tensor in tensors:
        tensor.copy_(torch.randn(tensor.numel()))
    return tensors


def _write(path: str, tensors) -> tuple:
    """Write the bucket; return its items' ``(offset, length, digest)`` and whether it
    was written with direct I/O (a file system that refuses it gets a buffered file)."""
    bucket = LocalBucketFile(path, hashing=True, direct_io=True)
    spans = []
    try:
        for tensor in tensors:
            head, tail = tensor_frame(tensor)
            bucket.start_item()
            offset = bucket.tell()
            bucket.append(head, tensor_bytes(tensor), tail)
            spans.append((offset, bucket.tell() - offset, bucket.finish_item()))
        bucket.finish(use_fsync=True)
        direct = bucket.writes_direct  # refused at open or at the first write: buffered
    finally:
        bucket.close()
    return spans, direct


def _check(path: str, tensors, spans) -> None:
    with open(path, "rb") as f:
        data = f.read()
    for (offset, length, digest), tensor in zip(spans, tensors):
        item = data[offset:offset + length]
        if xxhash.xxh3_64(item).hexdigest() != digest:
            raise SystemExit(f"{path}: digest mismatch at offset {offset}")
        if not torch.equal(torch.load(io.BytesIO(item)), tensor):
            raise SystemExit(f"{path}: the item at offset {offset} does not load back equal")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/megatron_async_direct_write_cpu")
    parser.add_argument("--mib", type=int, default=196)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--source", choices=["shared", "private"], default="shared")
    args = parser.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    tensors = _tensors(args.mib, args.source)
    user, system, wall = [], [], []
    for rep in range(args.reps):
        path = os.path.join(args.dir, f"bucket_{rep}.distcp")
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        spans, direct = _write(path, tensors)
        after, end = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        user.append(after.ru_utime - before.ru_utime)
        system.append(after.ru_stime - before.ru_stime)
        wall.append(end - start)
        _check(path, tensors, spans)
        os.remove(path)
    how = "direct I/O" if direct else "buffered (the file system refused O_DIRECT)"
    print(f"{args.mib} MiB from {args.source} memory, {how}, median of {args.reps}: "
          f"user {statistics.median(user) * 1e3:.0f} ms, system {statistics.median(system) * 1e3:.0f} ms, "
          f"wall {statistics.median(wall) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
