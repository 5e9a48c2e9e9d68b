"""Device-to-host copy throughput into the kinds of host memory staging can use (GPU only).

Copies ``--mib`` of one CUDA tensor to the host, best of ``--repeats``, into:

* pageable memory (``torch.empty``): what an unstaged ``tensor.cpu()`` gets;
* pinned memory (``torch.empty(pin_memory=True)``): the physical limit of a copy;
* one of our staging segments (shared memory, page-locked with ``pin_segment``), copied on
  the current stream and on a side stream (what overlapped staging uses).

The ratio of the segment's throughput to pinned memory's is what our staging gets of the
physical limit. Run it through ``tools/ci/gpu_checks.sh`` or directly::

    python -m tools.bench.micro.d2h_throughput --mib 1024

Tooling only: it prints, and never changes the library.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from megatron_async.core.shared_memory import allocate_segment, pin_segment


def _best_seconds(copy, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("d2h_throughput: no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    num_bytes = args.mib * 2**20
    source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    pageable = torch.empty(num_bytes, dtype=torch.uint8)
    pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    segment = allocate_segment(num_bytes)
    segment_pinned = pin_segment(segment)
    side = torch.cuda.Stream()

    def on_side_stream():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            segment.copy_(source, non_blocking=True)
        side.synchronize()

    rows = [
        ("pageable", _best_seconds(lambda: pageable.copy_(source), args.repeats)),
        ("pinned (physical limit)", _best_seconds(lambda: pinned.copy_(source, non_blocking=True),
                                                  args.repeats)),
        ("staging segment, current stream",
         _best_seconds(lambda: segment.copy_(source, non_blocking=True), args.repeats)),
        ("staging segment, side stream", _best_seconds(on_side_stream, args.repeats)),
    ]
    assert torch.equal(segment[:4096].cpu(), source[:4096].cpu()), "the segment copy is wrong"
    limit = rows[1][1]
    print(f"{torch.cuda.get_device_name()}: {args.mib} MiB device to host, best of "
          f"{args.repeats}; segment page-locked: {segment_pinned}")
    print("| destination | GB/s | x pinned |")
    print("|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {num_bytes / seconds / 1e9:.1f} | {limit / seconds:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
