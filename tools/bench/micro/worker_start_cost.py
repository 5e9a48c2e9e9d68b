"""Micro-benchmark: what starting the persistent worker costs the trainer.

One process holds ``--state-mib`` of CPU-resident state (think an offloaded optimizer)
and starts a :class:`~megatron_async.core.persistent.PersistentAsyncCaller` each way in
turn:

* ``fork``: as the library does;
* ``fork, pages kept``: the same fork without the worker dropping its share of the
  trainer's tensor pages (what the release saves).

Columns: the trainer's stall creating the caller, the time until the worker is ready,
the worker's CPU until then, the trainer's first in-place update of the whole state
after the start (copy-on-write faults show here) against a second one, and the memory
the worker then holds alone (``Private_Dirty``). Run it on a quiet machine::

    python -m tools.bench.micro.worker_start_cost --state-mib 384 --repeats 3

Tooling only: it prints, and never changes the library.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

from megatron_async.core import worker_process
from megatron_async.core.persistent import PersistentAsyncCaller

METHODS = ("fork", "fork, pages kept")
_READY_TIMEOUT_S = 60.0


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _private_dirty_mib(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(method: str, state: torch.Tensor) -> Dict[str, float]:
    """Start one worker with ``method``, time it and the trainer's next two updates, stop it."""
    original = worker_process.trainer_tensor_pages
    if method == "fork, pages kept":
        worker_process.trainer_tensor_pages = lambda: ([], [])
    try:
        started = time.monotonic()
        caller = PersistentAsyncCaller()
        created = time.monotonic()
        while not caller.is_worker_ready():
            if time.monotonic() - started > _READY_TIMEOUT_S:
                raise RuntimeError(f"{method}: the worker was not ready in {_READY_TIMEOUT_S}s")
            time.sleep(0.001)
        ready = time.monotonic()
    finally:
        worker_process.trainer_tensor_pages = original
    pid = caller.process.pid
    worker_cpu = _cpu_seconds(pid)
    first = time.monotonic()
    state.add_(1)
    second = time.monotonic()
    state.add_(1)
    done = time.monotonic()
    held = _private_dirty_mib(pid)
    caller.close()
    return {
        "stall_s": created - started,
        "ready_s": ready - started,
        "worker_cpu_s": worker_cpu,
        "first_update_s": second - first,
        "second_update_s": done - second,
        "worker_private_mib": held,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    state = torch.ones(args.state_mib * 2**20 // 4)
    state.add_(1)  # touch every page before the first start
    results: Dict[str, List[Dict[str, float]]] = {m: [] for m in METHODS}
    for _ in range(args.repeats):
        for method in METHODS:  # interleaved, so drift cancels
            results[method].append(measure(method, state))
    columns = ["stall_s", "ready_s", "worker_cpu_s", "first_update_s", "second_update_s",
               "worker_private_mib"]
    print(f"state {args.state_mib} MiB, median of {args.repeats}, torch {torch.__version__}")
    print("| method | create (trainer stall) | ready after | worker CPU to ready | "
          "trainer's 1st update after start | 2nd update | worker holds alone |")
    print("|---|---|---|---|---|---|---|")
    for method in METHODS:
        med = {c: statistics.median(r[c] for r in results[method]) for c in columns}
        print(f"| {method} | {med['stall_s'] * 1e3:.0f} ms | {med['ready_s'] * 1e3:.0f} ms | "
              f"{med['worker_cpu_s']:.2f} s | {med['first_update_s'] * 1e3:.0f} ms | "
              f"{med['second_update_s'] * 1e3:.0f} ms | {med['worker_private_mib']:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
