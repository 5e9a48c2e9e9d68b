"""Micro-benchmark: ``TorchAsyncCheckpoint`` (async ``torch.save``) within a staging budget.

One process saves a state of ``--tensors`` float32 tensors (``--mib`` MiB in all) with
``TorchAsyncCheckpoint`` at budgets of 1.0x, 0.5x and 0.25x the state, and with a plain
synchronous ``torch.save`` into a file object, and prints per case the median stall per
warm save (what ``async_save`` takes: pickling, staging and, below the state, the wait for
the writer to drain), the median time until the file is written, the peak staging shared
memory (our live segments, sampled every millisecond) and the rounds::

    PYTHONPATH=$PWD python -m tools.bench.micro.torch_save_budget --mib 256 --tensors 64 \\
        --saves 4 [--persistent] [--dir /tmp/tsb]

To compare with a build before the budget under the same load, run the ``default`` row of
an older library with this tool: ``git archive REV megatron_async | tar -x -C /tmp/before``,
then ``(cd /tmp/before && PYTHONPATH=/tmp/before:$OLDPWD python -m tools.bench.micro.torch_save_budget ...)``
(``-m`` puts the working directory first on the path).

Tooling only: it prints, and never changes the library.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import threading
import time

import torch

from megatron_async.core import shared_memory
from megatron_async.staging.budget import StagingLedger
from megatron_async.torch_ckpt import TorchAsyncCheckpoint

__all__ = ["main"]


class _PeakSampler(threading.Thread):
    """The most staging shared memory this process held while it ran (above a baseline)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        StagingLedger.of_process().drop_pool()  # an earlier case's pool: counted from zero
        gc.collect()
        self.baseline = shared_memory.live_bytes()
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, shared_memory.live_bytes() - self.baseline)
            self.stop.wait(0.001)


def _case(label, save, finish, state, saves, directory):
    stalls, totals = [], []
    sampler = _PeakSampler()
    sampler.start()
    for step in range(saves):
        path = os.path.join(directory, f"{label}-{step}.pt")
        start = time.perf_counter()
        save(state, path)
        stalled = time.perf_counter()
        finish()
        done = time.perf_counter()
        for tensor in state.values():
            tensor.add_(1.0)  # the next training step
        if step:  # the first save is cold
            stalls.append(stalled - start)
            totals.append(done - start)
    sampler.stop.set()
    sampler.join()
    return statistics.median(stalls), statistics.median(totals), sampler.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=64)  # 5000 shows the pickling cost
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    numel = args.mib * 2**20 // 4 // args.tensors
    state = {f"t{i}": torch.randn(numel) for i in range(args.tensors)}
    state_bytes = args.tensors * numel * 4
    directory = args.dir or tempfile.mkdtemp(prefix="torch-save-budget-")
    os.makedirs(directory, exist_ok=True)

    def sync_save(obj, path):
        with open(path, "wb") as stream:
            torch.save(obj, stream)
            stream.flush()
            os.fsync(stream.fileno())

    stall, total, _ = _case("sync", sync_save, lambda: None, state, args.saves, directory)
    print(f"state {state_bytes} bytes in {args.tensors} tensors, "
          f"{'persistent worker' if args.persistent else 'fork per save'}")
    print(f"sync torch.save: stall {stall:.3f}s")
    for factor in (None, 1.0, 0.5, 0.25):
        if factor is None:  # the default budget; also what a build before the budget runs
            ckpt, label = TorchAsyncCheckpoint(args.persistent), "default"
        else:
            ckpt = TorchAsyncCheckpoint(args.persistent, staging_memory_limit=int(state_bytes * factor))
            label = f"{factor:.2f}x"
        try:
            stall, total, peak = _case(
                label, ckpt.async_save, lambda: ckpt.finalize_async_save(blocking=True),
                state, args.saves, directory,
            )
            rounds = getattr(ckpt, "staging_stats", {}).get("rounds")
        finally:
            ckpt.close()
        print(f"budget {label}: stall {stall:.3f}s, written after {total:.3f}s, "
              f"peak staging {peak} bytes ({peak / state_bytes:.2f}x), {rounds} round(s)")
        if not hasattr(ckpt, "staging_memory_limit"):
            break  # a build before the budget: nothing more to compare

if __name__ == "__main__":
    main()
