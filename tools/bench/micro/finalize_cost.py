"""Micro-benchmark: what a save's finalization costs on the training thread, by phase.

Simulates ``--ranks`` ranks in one process, each with ``--items`` small tensors: every
rank's writer plans, stages and writes its bucket files, then the finalization runs as in
``save_state_dict_async_finalize``:

* ``retrieve``: one rank's ``retrieve_write_results`` (reads the background writer's
  result file);
* ``gather pickle``: pickling one rank's results for the gather;
* ``gather unpickle``: the coordinator unpickling every rank's results;
* ``finish``: the coordinator's ``finish`` (``.metadata``, fsyncs; checksums are
  recorded per rank by the background writers).

Each phase starts after a full garbage collection, so the collections it triggers itself
are counted (with tens of thousands of items they are much of the cost) but not those
left over from setting up. To compare revisions, run it twice in one go with
an extracted older ``megatron_async`` first on the path (``python -m`` puts the current
folder first, so run that one from the extracted folder, with this repository on
``PYTHONPATH`` for the tools; the first line printed says which package was timed)::

    git archive HEAD~1 megatron_async | tar -x -C /tmp/before
    (cd /tmp/before && PYTHONPATH="$OLDPWD" python -m tools.bench.micro.finalize_cost)
    python -m tools.bench.micro.finalize_cost

Tooling only: it prints, and never changes the library.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StoragePrefix

import megatron_async
from megatron_async.writer.filesystem import FileSystemWriterAsync, WriteOptions


def _timed(fn):
    gc.collect()
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def finalize_once(directory: str, ranks: int, items: int, use_checksums: bool) -> Dict[str, float]:
    """Save ``ranks`` x ``items`` tensors into ``directory`` and time the finalization phases."""
    planners, writers, local_plans = [], [], []
    for rank in range(ranks):
        state_dict = {f"r{rank}.p{i}": torch.randn(16) for i in range(items)}
        planner = DefaultSavePlanner(flatten_state_dict=False)
        planner.set_up_planner(state_dict, is_coordinator=rank == 0)
        writer = FileSystemWriterAsync(
            directory, options=WriteOptions(thread_count=2, checksums=use_checksums)
        )
        writer.set_up_storage_writer(rank == 0)
        planners.append(planner)
        writers.append(writer)
        local_plans.append(writer.prepare_local_plan(planner.create_local_plan()))
    _, metadata = planners[0].create_global_plan(local_plans)
    blobs: List[bytes] = []
    times: Dict[str, float] = {"retrieve": 0.0, "gather pickle": 0.0}
    for rank, (planner, writer, local_plan) in enumerate(zip(planners, writers, local_plans)):
        plan = dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{rank}_"))
        writer.prepare_write_data(planner.finish_plan(plan), planner)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        save_fn(args[0], preload_fn(), args[2])
        results, elapsed = _timed(writer.retrieve_write_results)
        times["retrieve"] += elapsed / ranks
        blob, elapsed = _timed(lambda: pickle.dumps(results))
        times["gather pickle"] += elapsed / ranks
        blobs.append(blob)
    gathered, times["gather unpickle"] = _timed(lambda: [pickle.loads(blob) for blob in blobs])
    _, times["finish"] = _timed(lambda: writers[0].finish(metadata, gathered))
    times["total"] = sum(times.values())
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, nargs="+", default=[2000, 20000], help="per rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    args = parser.parse_args(argv)
    # A trainer-sized heap, so that garbage collections cost what they would there.
    import megatron.core  # noqa: F401

    where = os.path.dirname(megatron_async.__file__)
    print(f"megatron_async from {where}; {args.ranks} ranks; medians of {args.reps}, ms")
    for items in args.items:
        for use_checksums in (True, False):
            runs = []
            for _ in range(args.reps):
                directory = tempfile.mkdtemp(dir=args.dir)
                try:
                    runs.append(finalize_once(directory, args.ranks, items, use_checksums))
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
            medians = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
            phases = ", ".join(f"{name} {seconds * 1e3:.0f}" for name, seconds in medians.items())
            label = "checksums" if use_checksums else "no checksums"
            print(f"{items:>6} items/rank, {label:>12}: {phases}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
