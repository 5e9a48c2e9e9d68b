"""Training time lost per checkpoint, measured inside a real training loop (a rank job).

Every rank trains the GPT example's model with its distributed optimizer, built with
the example's own functions (``build_model``, ``build_optimizer``, ``train_step``), and
checkpoints it with one method. Iterations are timed the way the example's loop runs
them: each one first polls for finished saves (non-blocking), then trains a step.

Order (the warm-up is three iterations once the model is built):

1. set the method up, timed: for ours, the example's queue (and with the persistent
   caller the worker start) before the model is built, as the example and Megatron-LM
   create it, then the example's ``Checkpointer``; the model's build time is recorded;
2. per save: a *free window* of ``window`` iterations without any save in flight, then
   the save call (its *stall*) and iterations until the checkpoint is durable on every
   rank (the *save window*; the ranks agree each iteration, as the example's finalize
   does).

The first free window follows the set-up, so it carries what the set-up still costs
afterwards; the others give the checkpoint-free iteration time, interleaved with the
saves so that drift cancels. Our queue is created before the model, so a persistent
worker's start-up shows in ``build_s`` and the warm-up times, which the report puts beside
every row. Per-iteration times
are the maximum over ranks (a step is as slow as its slowest rank).

Methods (:data:`~.config.LOST_TIME_METHODS`, built by :mod:`.methods.catalog`):

* ``sync``: the example without ``--async-save`` (our strategy, synchronous);
* ``ours_temporal`` / ``ours_persistent``: ``--async-save`` (``--use-persistent-ckpt-worker``)
  ``--ckpt-assume-constant-structure`` (the worker forked from the trainer);
  ``ours_persistent_overlap`` adds
  ``--ckpt-overlap-staging``;
* ``ours_local_f1`` / ``ours_local_f2``: ``ours_persistent``'s flags, but every save a
  local checkpoint (``--non-persistent-ckpt-type local``, atomic algo), not replicated,
  or replicated with F = 2 and J = ranks / 2 (an even number of ranks, 2 or more; on one
  machine every "node" shares the checkpoint root and the cores), to compare with
  ``ours_persistent``;
* ``dcp_thread`` / ``dcp_process``: ``dcp.async_save`` with its thread or process
  executor and one reused ``DefaultStager`` (synchronous staging; shared memory for the
  process executor);
* ``dcp_async_staging``: ``dcp.async_save`` (thread executor) with
  ``DefaultStager(StagingOptions(use_async_staging=True))``; the next optimizer step
  waits for its staging future (a torch optimizer step pre-hook), as torchtitan does.
"""

from __future__ import annotations

import datetime
import os
import shutil
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .config import EXAMPLE_FLAGS, LOST_TIME_LOCAL_METHODS
from .gpt_example import ExampleTrainer
from .launch import RankContext
from .methods.base import SaveMethod, now
from .methods.catalog import build_lost_time_method

__all__ = ["lost_time_job"]

_WARMUP_ITERATIONS = 3
_MAX_SAVE_WINDOW = 200
"""Iterations a save window may take before the benchmark waits for the save (blocking)."""


def _memcpy_seconds(num_bytes: int, group) -> float:
    """One copy of this rank's state to host memory, every rank at once (best of three).

    With CUDA, the state lives on the device and staging copies it to page-locked host
    memory, so the copy timed is device to pinned host memory (staging's physical limit,
    as ``tools.bench.micro.d2h_throughput`` measures it); on a CPU-only host, host to host.
    """
    on_gpu = torch.cuda.is_available()
    size = (max(num_bytes, 1),)
    src = torch.randint(0, 255, size, dtype=torch.uint8, device="cuda" if on_gpu else "cpu")
    dst = torch.empty(size, dtype=torch.uint8, pin_memory=on_gpu)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        dist.barrier(group=group)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _timed_iteration(trainer: ExampleTrainer, method: Optional[SaveMethod],
                     polls: Optional[list] = None) -> tuple:
    """One loop iteration (poll, then train); returns ``(seconds, durable)``.

    With ``polls``, the poll's own time (where a finished save is finalized) is appended.
    """
    start = now()
    durable = method.poll() if method is not None else True
    if polls is not None:
        polls.append(now() - start)
    trainer.step()
    return now() - start, durable


class _CpuMeter:
    """CPU seconds (user + system) used by this rank's process and by its background
    processes (every descendant: forked writers, the persistent worker), and by the whole
    machine (``/proc/stat``, all cores), between :meth:`start` and :meth:`stop`."""

    def __init__(self):
        import psutil

        self._me = psutil.Process()

    def _background_seconds(self) -> float:
        """CPU time of every live descendant and of every descendant already reaped.

        A reaped child's time (its own reaped children's included) is in this process's
        ``children_*`` counters; a live one's reaped children are in its own.
        """
        total = 0.0
        for child in self._me.children(recursive=True):
            try:
                t = child.cpu_times()
            except Exception:  # it ended between listing and reading
                continue
            total += t.user + t.system + t.children_user + t.children_system
        own = self._me.cpu_times()
        return total + own.children_user + own.children_system

    @staticmethod
    def _machine_seconds() -> Dict[str, float]:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        tick = os.sysconf("SC_CLK_TCK")
        names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
        return {n: int(v) / tick for n, v in zip(names, fields)}

    def start(self) -> None:
        times = self._me.cpu_times()
        self._own = times.user + times.system
        self._children = self._background_seconds()
        self._machine = self._machine_seconds()

    def stop(self) -> Dict[str, float]:
        times = self._me.cpu_times()
        machine = self._machine_seconds()
        result = {"rank_cpu_s": times.user + times.system - self._own,
                  "background_cpu_s": self._background_seconds() - self._children}
        result.update({f"machine_{n}_s": machine[n] - self._machine[n] for n in machine})
        return result


def lost_time_job(ctx: RankContext) -> Dict[str, Any]:
    """Train with saves of ``payload["method"]`` and time every iteration (every rank).

    Returns this rank's timings: ``setup_s``, ``warmup``, ``windows`` (one per save:
    ``free`` iteration times, ``stall_s``, ``save`` iteration times until durable,
    ``blocking_wait_s`` when the save outlived the window bound), the state's bytes
    and one memory copy's time.
    """
    payload = ctx.payload
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=900))
    root = os.path.join(payload["checkpoint_root"], payload["tag"])
    if ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier(group=group)
    name = payload["method"]
    local_flags = []
    if name in LOST_TIME_LOCAL_METHODS:  # with F = 2 each rank's part also on the rank J away
        local_flags = ["--non-persistent-local-ckpt-dir", os.path.join(root, "local"),
                       "--replication-jump", str(ctx.world_size // 2)]
    trainer = ExampleTrainer(payload["num_layers"], payload["hidden_size"], [
        "--train-iters", "1000000", "--save", root, "--save-interval", "1",
        *EXAMPLE_FLAGS.get(name, []), *local_flags])
    method = build_lost_time_method(name, trainer)
    try:
        # As the example (and Megatron-LM) does: the queue, and with it the persistent
        # worker, before the model. Its time counts as set-up; the model's build time is
        # recorded so that any cost the early worker moves into the build stays visible.
        dist.barrier(group=group)
        start = now()
        method.start_early()
        early_setup_s = now() - start
        start = now()
        trainer.build()
        build_s = now() - start
        # Warm-up first: the optimizer state exists only after a step.
        warmup = [_timed_iteration(trainer, None)[0] for _ in range(_WARMUP_ITERATIONS)]
        num_bytes = sum(t.numel() * t.element_size() for t in trainer.dcp_state_dict().values())
        result: Dict[str, Any] = {"rank": ctx.rank, "num_bytes": num_bytes, "warmup": warmup,
                                  "build_s": build_s, "early_setup_s": early_setup_s,
                                  "memcpy_s": _memcpy_seconds(num_bytes, group)}
        dist.barrier(group=group)
        start = now()
        method.setup()
        result["setup_s"] = early_setup_s + now() - start
        windows: List[Dict[str, Any]] = []
        meter = _CpuMeter()
        for index in range(payload["saves"]):
            window: Dict[str, Any] = {"free": [], "save": [], "save_polls": [],
                                      "blocking_wait_s": 0.0}
            meter.start()
            for _ in range(payload["window"]):
                window["free"].append(_timed_iteration(trainer, method)[0])
            window["free_cpu"] = meter.stop()
            meter.start()
            start = now()
            method.save(os.path.join(root, f"iter_{index:07d}"), index)
            window["stall_s"] = now() - start
            durable = False
            while not durable and len(window["save"]) < _MAX_SAVE_WINDOW:
                seconds, durable = _timed_iteration(trainer, method, window["save_polls"])
                # The iteration that found the save durable finalized it inside its poll.
                window["save"].append(seconds)
            if not durable:
                start = now()
                method.wait()
                window["blocking_wait_s"] = now() - start
            window["save_cpu"] = meter.stop()
            windows.append(window)
    finally:
        method.close()
        dist.barrier(group=group)
        if ctx.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    result["windows"] = windows
    return result
