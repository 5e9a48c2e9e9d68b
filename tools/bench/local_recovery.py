"""Recovery after a lost node, and the host memory of a replicated local save (a rank job).

Every rank builds the same synthetic state (:class:`~.workloads.SyntheticWorkload`:
``tensor_count`` shards, ``bytes_per_rank`` in all) and checkpoints it twice with our
code, each method on its own persistent queue (one background writer process at a time):

1. ``ours_local_f2``: :class:`~megatron_async.local.manager.LocalCheckpointManager`
   with ``CliqueReplicationStrategy.from_replication_params(J, 2)``, J = ranks / 2, so
   ranks ``[0, J)`` and ``[J, ranks)`` play two nodes and every part has a replica on the
   other one; the state wrapped in a ``BasicTensorAwareStateDict``;
2. ``ours_persistent``: our async ``torch_dist`` save through megatron-core's
   ``dist_checkpointing.save`` (:class:`~.methods.queue.OurQueueSave`, as the main table's
   ``ours_persistent``).

Each method saves twice; the second (warm) save is measured: the peak of the process's
:class:`~megatron_async.staging.budget.StagingLedger` (staging memory held, restarted at
the bytes held before the save), the peak RSS growth of the trainer and of its
background writer over their RSS just before the save (:class:`~.memory.RssSampler`),
and the PSS held once the save is complete.

Then the second node is lost: rank 0 deletes the holder directories of ranks
``[J, ranks)``. Each trial times, on every rank, a fresh manager's ``find_latest()`` +
``load()`` (the lost ranks' parts come from their peers' replicas) and
``dist_checkpointing.load`` of the persistent checkpoint into the same sharded state dict.
Condition ``warm``: the files are in the page cache (just written or read). ``cold``:
before each timed load, rank 0 fsyncs every file under both checkpoints and drops it
from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``, best effort: pages another
process maps stay). The lost node's directories are deleted again before every local
trial (recovery writes the received parts back).
"""

from __future__ import annotations

import datetime
import gc
import os
import shutil
from typing import Any, Dict, List

import torch.distributed as dist

from megatron_async.local.parts import holder_dir

from .launch import RankContext
from .memory import RssSampler, current_rss, tree_pss_bytes, wait_for_quiet_children
from .methods.base import now
from .methods.queue import OurQueueSave
from .workloads import SyntheticWorkload

__all__ = ["local_recovery_job", "evict_from_page_cache"]

REPLICATION_FACTOR = 2
CONDITIONS = ("warm", "cold")
_WORKER_START_TIMEOUT_S = 120.0
_ITERATION = 2
"""The iteration measured, and recovered: the second save of each method."""


def evict_from_page_cache(directories: List[str]) -> int:
    """Fsync every file under ``directories`` and drop its pages from the page cache
    (best effort, no root needed); return the number of files dropped."""
    dropped = 0
    for directory in directories:
        for parent, _, names in os.walk(directory):
            for name in names:
                fd = os.open(os.path.join(parent, name), os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages are not dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    dropped += 1
                finally:
                    os.close(fd)
    return dropped


class _LocalSaves:
    """The local tier as Megatron-LM's ``--non-persistent-ckpt-type local`` uses it
    (trainer, every rank): one manager, its requests scheduled on our persistent queue."""

    name = "ours_local_f2"

    def __init__(self, root: str, jump: int, workload: SyntheticWorkload):
        self.root, self.jump, self.workload = root, jump, workload
        self.queue = None

    def new_manager(self):
        """A manager as a (re)started job builds it."""
        from megatron_async.local.cliques import CliqueReplicationStrategy
        from megatron_async.local.manager import LocalCheckpointManager

        strategy = CliqueReplicationStrategy.from_replication_params(self.jump,
                                                                     REPLICATION_FACTOR)
        return LocalCheckpointManager(self.root, repl_strategy=strategy, algo="atomic")

    def setup(self) -> None:
        from megatron_async.core import AsyncCallerConfig, AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=True,
                                     config=AsyncCallerConfig(poll_interval_s=0.005))
        self.manager = self.new_manager()

    def save(self, iteration: int) -> None:
        from megatron_async.local.state_dict import BasicTensorAwareStateDict

        state = BasicTensorAwareStateDict(dict(self.workload.dcp_state_dict()))
        self.queue.schedule_async_request(self.manager.save(state, iteration, is_async=True))

    def wait(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()


class _PersistentSaves:
    """Our async ``torch_dist`` save on our persistent queue (trainer, every rank), one
    directory ``iter_<iteration>`` per save."""

    name = "ours_persistent"

    def __init__(self, root: str, workload: SyntheticWorkload, thread_count: int, group):
        self.root, self.group = root, group
        self.method = OurQueueSave(self.name, workload, os.path.join(root, "_stamps"),
                                   persistent=True, thread_count=thread_count)

    def directory(self, iteration: int) -> str:
        return os.path.join(self.root, f"iter_{iteration:07d}")

    def setup(self) -> None:
        self.method.setup()

    def save(self, iteration: int) -> None:
        if dist.get_rank() == 0:
            os.makedirs(self.directory(iteration))
        dist.barrier(group=self.group)
        self.method.save(self.directory(iteration), iteration)

    def wait(self) -> None:
        self.method.wait()

    def close(self) -> None:
        self.method.close()


def _measure_warm_save(saves, iteration: int, state_bytes: int, sampler: RssSampler,
                       group) -> Dict[str, Any]:
    """Save ``iteration`` with the peaks of its staging memory and RSS over the moment
    before it (``saves`` is set up and warm)."""
    from megatron_async.staging.budget import StagingLedger

    ledger = StagingLedger.of_process()
    gc.collect()
    dist.barrier(group=group)
    trainer_rss, writer_rss = current_rss()
    ledger.peak_bytes = ledger.held_bytes()
    sampler.take_peaks()
    start = now()
    saves.save(iteration)
    stall_s = now() - start
    saves.wait()
    e2e_s = now() - start
    peak_trainer, peak_writer = sampler.take_peaks()
    gc.collect()
    pss_trainer, pss_background = tree_pss_bytes()
    return {"method": saves.name, "budget_bytes": state_bytes,
            "staging_peak_bytes": ledger.peak_bytes,
            "trainer_rss_growth_bytes": max(peak_trainer - trainer_rss, 0),
            "writer_rss_growth_bytes": max(peak_writer - writer_rss, 0),
            "trainer_rss_before_bytes": trainer_rss, "writer_rss_before_bytes": writer_rss,
            "pss_after_bytes": pss_trainer + pss_background, "stall_s": stall_s,
            "e2e_s": e2e_s}


def _save_twice(saves, state_bytes: int, sampler: RssSampler, group) -> Dict[str, Any]:
    """Set a method up, save iteration 1 (cold), then measure iteration 2 (warm)."""
    saves.setup()
    try:
        wait_for_quiet_children(_WORKER_START_TIMEOUT_S)  # the persistent writer started
        saves.save(1)
        saves.wait()
        return _measure_warm_save(saves, _ITERATION, state_bytes, sampler, group)
    finally:
        saves.close()


def _time_local_recovery(local: _LocalSaves, group) -> Dict[str, float]:
    """A restarted job's ``find_latest()`` + ``load()`` on a fresh manager, timed."""
    manager = local.new_manager()
    dist.barrier(group=group)
    start = now()
    iteration = manager.find_latest()
    found = now()
    if iteration != _ITERATION:
        raise RuntimeError(f"rank {dist.get_rank()}: local recovery found iteration "
                           f"{iteration}, not {_ITERATION}")
    state, _ = manager.load()
    end = now()
    if len(state.tensors) != local.workload.tensor_count:
        raise RuntimeError(f"rank {dist.get_rank()}: the recovered state has "
                           f"{len(state.tensors)} tensors, not {local.workload.tensor_count}")
    return {"local_s": end - start, "local_find_latest_s": found - start,
            "local_load_s": end - found}


def _time_persistent_load(workload: SyntheticWorkload, directory: str, group) -> float:
    """megatron-core's ``dist_checkpointing.load`` of the same sharded state, timed."""
    from megatron.core import dist_checkpointing

    state = workload.sharded_state_dict(_ITERATION)
    dist.barrier(group=group)
    start = now()
    dist_checkpointing.load(state, directory)
    return now() - start


def local_recovery_job(ctx: RankContext) -> Dict[str, Any]:
    """Save the state with both methods, lose a node and time both recoveries (every rank).

    Returns this rank's ``memory`` (one record per method, :func:`_measure_warm_save`)
    and ``recovery``: per condition, one list per timing (``local_s`` = find_latest +
    load, its two parts, ``persistent_load_s``), one value per trial.
    """
    payload, rank, world = ctx.payload, ctx.rank, ctx.world_size
    jump = world // 2
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=900))
    root = os.path.join(payload["checkpoint_root"], payload["tag"])
    local_root, persistent_root = os.path.join(root, "local"), os.path.join(root, "persistent")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(os.path.join(persistent_root, "_stamps"))
    dist.barrier(group=group)
    workload = SyntheticWorkload(rank, world, payload["bytes_per_rank"],
                                 payload["tensor_count"], payload["dtype"])
    sampler = RssSampler(payload["rss_interval_s"])
    result: Dict[str, Any] = {"rank": rank, "num_bytes": workload.num_bytes, "recovery": {}}
    try:
        local = _LocalSaves(local_root, jump, workload)
        persistent = _PersistentSaves(persistent_root, workload, payload["thread_count"], group)
        result["memory"] = [_save_twice(saves, workload.num_bytes, sampler, group)
                            for saves in (local, persistent)]
        lost_holders = [holder_dir(local_root, "", r) for r in range(jump, world)]
        cached = [local_root, persistent.directory(_ITERATION)]
        for condition in CONDITIONS:
            trials: Dict[str, List[float]] = {}
            for _ in range(payload["repeats"]):
                if rank == 0:
                    for holder in lost_holders:  # recovery wrote the lost parts back
                        shutil.rmtree(holder, ignore_errors=True)
                for what in ("local", "persistent"):
                    if condition == "cold" and rank == 0:
                        result["evicted_files"] = evict_from_page_cache(cached)
                    if what == "local":
                        timings = _time_local_recovery(local, group)
                    else:
                        timings = {"persistent_load_s": _time_persistent_load(
                            workload, persistent.directory(_ITERATION), group)}
                    for key, value in timings.items():
                        trials.setdefault(key, []).append(value)
                    gc.collect()
            result["recovery"][condition] = trials
    finally:
        sampler.close()
        dist.barrier(group=group)
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return result
