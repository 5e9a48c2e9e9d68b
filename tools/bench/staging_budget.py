"""Staging memory budget benchmark: peak host memory and lost time per save at budgets of
1.0x, 0.5x and 0.25x the state, and at 0.5x and 0.25x with overlapped staging, against a
synchronous save (gloo, CPU).

One command (the lead reruns it on a quiet machine)::

    PYTHONPATH=$PWD python -m tools.bench.staging_budget --ranks 2 --mib-per-rank 256 \
        --saves 3 --out bench_results/staging_budget.json

Per rank and budget it reports: the state's bytes, the peak staging shared memory (our
live segments, sampled every millisecond), the peak RSS of the trainer process (which
includes the shared pages it touched) and of its background processes, the lost time per
warm save (what the training loop waits: planning plus staging, and with a budget below
the state the wait for the writer to drain), and the rounds. Ranks run as processes of
this machine; ``--persistent`` uses the persistent worker instead of a fork per save.

After scheduling, every row sleeps ``--step-s`` (a forward/backward that leaves the cores
to the copy and the writer) and then waits as the next optimizer step would
(``wait_for_staging``): lost time = scheduling + that wait. Only the overlapped rows wait
there (under a budget, for the last round to be copied while the writer drains).

``--default-only`` runs a sync save and the strategy's defaults alone (the budget's default
is one copy of the state), so the same command times a revision from before the budget::

    git archive a06adb1 megatron_async | tar -x -C /tmp/before
    (cd /tmp/before && PYTHONPATH=/tmp/before:$OLDPWD python -m tools.bench.staging_budget \
        --default-only)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["main"]

_FACTORS = (1.0, 0.5, 0.25)
_OVERLAPPED_FACTORS = (0.5, 0.25)


def _state(rank, world, tensors, numel, scale):
    from megatron.core.dist_checkpointing import ShardedTensor

    return {
        f"w{i}": ShardedTensor.from_rank_offsets(
            f"w{i}", torch.full((numel,), float(scale + i)), (0, rank, world)
        )
        for i in range(tensors)
    }


class _ShmPeak:
    def __init__(self):
        from megatron_async.core import shared_memory

        self._live = getattr(shared_memory, "live_bytes", lambda: 0)  # 0: a revision without it
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._live())
            self._stop.wait(0.001)

    def take(self):
        peak, self.peak = self.peak, self._live()
        return peak

    def stop(self):
        self._stop.set()
        self._thread.join()


def _rank_main(rank, args, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    import gc

    from megatron.core import dist_checkpointing

    import megatron_async
    from megatron_async import AsyncCallsQueue, TorchDistAsyncSaveStrategy
    from megatron_async.staging.budget import StagingBufferCache
    from megatron_async.staging.overlapped import wait_for_staging
    from tools.bench.memory import RssSampler

    try:
        from megatron_async.staging.budget import StagingLedger
    except ImportError:  # --default-only against a revision from before the budget
        StagingLedger = None
    if rank == 0:
        print(f"megatron_async from {os.path.dirname(megatron_async.__file__)}", flush=True)

    numel = args.mib_per_rank * 2**20 // 4 // args.tensors
    state_bytes = numel * 4 * args.tensors
    queue = AsyncCallsQueue(persistent=args.persistent)
    rss = RssSampler(0.002)
    shm = _ShmPeak()
    results = []
    if args.default_only:  # the strategy's defaults: runs against any revision
        rows = [("sync", None, False), ("default", 1.0, False)]
    else:
        rows = [("sync", None, False)] + [(f"{f}x", f, False) for f in _FACTORS]
        rows += [(f"{f}x ovl", f, True) for f in _OVERLAPPED_FACTORS]
    for label, factor, overlap in rows:
        StagingBufferCache.of_process().clear()
        if StagingLedger is not None:
            StagingLedger.of_process().drop_pool()
        gc.collect()
        if args.default_only:
            limit, strategy = None, TorchDistAsyncSaveStrategy()
        else:
            limit = None if factor is None else max(int(state_bytes * factor), 1)
            strategy = TorchDistAsyncSaveStrategy(staging_memory_limit=limit, overlap_staging=overlap)
        lost, waits, peaks_shm, peaks_rss, peaks_children = [], [], [], [], []
        for step in range(args.saves + 1):  # the first save is the cold one, not counted
            path = os.path.join(out_dir, f"{label.replace(' ', '-')}-{step}")
            if rank == 0:
                os.makedirs(path, exist_ok=True)
            dist.barrier()
            state = _state(rank, args.ranks, args.tensors, numel, step)
            shm.take()
            rss.take_peaks()
            start = time.perf_counter()
            if factor is None:
                dist_checkpointing.save(state, path, sharded_strategy=strategy)
            else:
                request = dist_checkpointing.save(
                    state, path, sharded_strategy=strategy, async_sharded_save=True
                )
                queue.schedule_async_request(request)
            stall = time.perf_counter() - start
            time.sleep(args.step_s)  # forward and backward of the next step
            start = time.perf_counter()
            wait_for_staging()  # what the next optimizer step waits
            wait = time.perf_counter() - start
            queue.maybe_finalize_async_calls(blocking=True)
            own, children = rss.take_peaks()
            if step:
                lost.append(stall + wait)
                waits.append(wait)
                peaks_shm.append(shm.take())
                peaks_rss.append(own)
                peaks_children.append(children)
            dist.barrier()
        results.append({
            "budget": label,
            "overlap_staging": overlap,
            "state_bytes": state_bytes,
            "limit_bytes": limit,
            "lost_s_median": statistics.median(lost),
            "step_wait_s_median": statistics.median(waits),
            "peak_staging_shm_bytes": max(peaks_shm),
            "peak_trainer_rss_bytes": max(peaks_rss),
            "peak_background_rss_bytes": max(peaks_children),
        })
    shm.stop()
    queue.close()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as stream:
        json.dump(results, stream)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--saves", type=int, default=3, help="warm saves per budget")
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--step-s", type=float, default=0.5,
                        help="simulated forward/backward between a save and the next optimizer step")
    parser.add_argument("--default-only", action="store_true",
                        help="only a sync save and the strategy's defaults (no budget argument): "
                             "compares revisions, including ones from before the budget")
    parser.add_argument("--ckpt-dir", default=None, help="where checkpoints go (a temp dir)")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.ckpt_dir) as out_dir:
        mp.start_processes(_rank_main, (args, port, out_dir), nprocs=args.ranks, start_method="spawn")
        per_rank = []
        for rank in range(args.ranks):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as stream:
                per_rank.append(json.load(stream))
    mib = 2**20
    print(f"{'budget':>10} {'state MiB':>9} {'staging shm MiB':>15} {'trainer RSS MiB':>15} "
          f"{'writer RSS MiB':>14} {'lost s/save':>11} {'in step s':>9}   (worst rank)")
    for rows in zip(*per_rank):
        worst = max(rows, key=lambda r: r["lost_s_median"])
        print(f"{worst['budget']:>10} {worst['state_bytes'] / mib:>9.0f} "
              f"{max(r['peak_staging_shm_bytes'] for r in rows) / mib:>15.1f} "
              f"{max(r['peak_trainer_rss_bytes'] for r in rows) / mib:>15.0f} "
              f"{max(r['peak_background_rss_bytes'] for r in rows) / mib:>14.0f} "
              f"{worst['lost_s_median']:>11.3f} {worst['step_wait_s_median']:>9.3f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as stream:
            json.dump({"args": vars(args), "per_rank": per_rank}, stream, indent=1)


if __name__ == "__main__":
    main()
