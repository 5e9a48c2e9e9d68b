"""Micro-benchmark: one bucket through ``write_bucket`` against a plain write + fsync.

One process writes a bucket of ``--mib`` MiB split into N float32 tensors (one file per
write), alternating with a plain ``os.write`` + ``fsync`` of the same byte count to the
same directory, and prints the median throughput of each and their ratio to the plain
write (the "background write >= 0.8 x disk" target). ``overlapped`` is the plain write
with the writer's writeback overlap (``posix_fadvise`` every 16 MiB): the ceiling for
the writer on this disk. With ``--baseline-ref REV`` it also times ``write_bucket``
as it was at git revision ``REV`` in the same run, so before/after compare under the same
machine load::

    python -m tools.bench.micro.bucket_write --dir /tmp/wb --counts 100 2000 \\
        --baseline-ref HEAD~1

Tooling only: it prints, and never changes the library.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types
from typing import Callable, Dict, List

import torch
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megatron_async.writer import bucket_io, tensor_archive
from megatron_async.buckets.layout import WriteBucket

_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def build_bucket(directory: str, total_bytes: int, count: int) -> WriteBucket:
    """A staged bucket of ``count`` contiguous float32 CPU tensors, ``total_bytes`` in all."""
    numel = max(1, total_bytes // 4 // count)
    tensor_data = []
    for i in range(count):
        tensor = torch.randn(numel)
        item = WriteItem(
            index=MetadataIndex(f"bench.t{i}", (0,)),
            type=WriteItemType.TENSOR,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=tensor.shape),
                properties=TensorProperties(dtype=tensor.dtype),
                size=tensor.shape,
            ),
        )
        tensor_data.append((item, tensor))
    name = "__0_0.distcp"
    return WriteBucket(os.path.join(directory, name), name, ([], tensor_data))


def _module_at(rev: str, name: str) -> types.ModuleType:
    """``megatron_async.<name>`` as it was at git revision ``rev``, as a separate module."""
    source = subprocess.run(
        ["git", "show", f"{rev}:megatron_async/{name}.py"],
        cwd=_REPO_ROOT, check=True, capture_output=True, text=True,
    ).stdout
    module = types.ModuleType(f"_{name}_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:{name}.py", "exec"), module.__dict__)
    return module


def load_write_bucket_at(rev: str) -> Callable:
    """``write_bucket`` as it was at git revision ``rev`` (one from before the package
    layout of issue 10, when it lived in ``megatron_async/_write_buckets.py``), with that
    revision's checksums module and today's tensor archive."""
    aliases = {
        "megatron_async.checksums": _module_at(rev, "checksums"),
        "megatron_async._tensor_archive": tensor_archive,
    }
    saved = {name: sys.modules.get(name) for name in aliases}
    sys.modules.update(aliases)
    try:
        return _module_at(rev, "_write_buckets").write_bucket
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def plain_write(path: str, payload: memoryview, overlap_writeback: bool = False) -> None:
    """Sequential write of ``payload``, then fsync: the disk's reference.

    64 MiB per call; with ``overlap_writeback``, 16 MiB per call, each followed by
    ``posix_fadvise(DONTNEED)`` to start its writeback at once (what the writer does).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        step = (16 if overlap_writeback else 64) << 20
        for start in range(0, payload.nbytes, step):
            chunk = payload[start : start + step]
            done = 0
            while done < chunk.nbytes:
                done += os.write(fd, chunk[done:])
            if overlap_writeback:
                os.posix_fadvise(fd, start, chunk.nbytes, os.POSIX_FADV_DONTNEED)
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(fn: Callable[[], None], path: str) -> float:
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    os.remove(path)
    return elapsed


def run(args: argparse.Namespace) -> None:
    os.makedirs(args.dir, exist_ok=True)
    total = args.mib << 20
    payload = memoryview(bytearray(os.urandom(1 << 20)) * args.mib)
    transforms = _StorageWriterTransforms()
    writers: Dict[str, Callable] = {"now": bucket_io.write_bucket}
    if args.baseline_ref:
        writers[args.baseline_ref] = load_write_bucket_at(args.baseline_ref)
    plain_path = os.path.join(args.dir, "plain.bin")
    print(f"{args.mib} MiB per write, {args.reps} repetitions, medians; checksums={args.checksums}")
    for count in args.counts:
        bucket = build_bucket(args.dir, total, count)
        times: Dict[str, List[float]] = {"plain": [], "overlapped": []}
        times.update({name: [] for name in writers})
        timed(lambda: plain_write(plain_path, payload), plain_path)  # warm-up
        for _ in range(args.reps):
            times["plain"].append(timed(lambda: plain_write(plain_path, payload), plain_path))
            times["overlapped"].append(
                timed(lambda: plain_write(plain_path, payload, True), plain_path)
            )
            for name, write in writers.items():
                times[name].append(
                    timed(lambda: write(transforms, bucket, True, args.checksums), bucket.file_path)
                )
        plain_s = statistics.median(times["plain"])
        line = [f"{count:>6} tensors: plain {total / plain_s / 1e9:.2f} GB/s"]
        for name in ["overlapped", *writers]:
            median_s = statistics.median(times[name])
            line.append(f"{name} {total / median_s / 1e9:.2f} GB/s ({plain_s / median_s:.2f} x)")
        print(", ".join(line), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/megatron_async_bucket_write")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--counts", type=int, nargs="+", default=[100, 2000])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-checksums", dest="checksums", action="store_false")
    parser.add_argument("--baseline-ref", help="also time write_bucket at this git revision")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
