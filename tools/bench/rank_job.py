"""What every rank runs in one launch: N consecutive saves of one method on one workload.

Order on every rank:

1. import every checkpointing module, build the workload, then read the memory baseline
   (PSS of the rank);
2. set the save method up (queue, persistent worker, stager); for a persistent worker,
   wait until it finished starting (a training job saves long after start-up), then
   read the idle baseline;
3. per save: a fresh directory, the save itself the way a training loop runs it (the
   save call, one training step while the write goes on, then the wait until the
   checkpoint is complete; see :func:`save_once`), the peak RSS of the rank and of its
   background process during the save, then the PSS held once the save is complete;
   rank 0 records the bytes on disk and deletes the previous checkpoint.

A method that cannot run here (:class:`~.methods.base.Unsupported`, e.g. megatron-core's async
save without CUDA) ends the launch with status ``unsupported`` and the reason, the same
on every rank.
"""

from __future__ import annotations

import datetime
import gc
import os
import shutil
from typing import Any, Dict, List

import psutil
import torch.distributed as dist

from .launch import RankContext
from .memory import RssSampler, tree_pss_bytes, wait_for_quiet_children
from .methods.base import SaveMethod, Unsupported, now
from .methods.catalog import build_variant
from .workloads import Workload, build_workload

__all__ = ["variant_job", "save_once"]

_WORKER_START_TIMEOUT_S = 120.0


def _directory_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def _agree_on_reason(reason: str, group) -> str:
    """Every rank's reason (empty when fine) -> the first non-empty one, on every rank."""
    reasons: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    return next((r for r in reasons if r), "")


def _import_checkpointing_modules() -> None:
    """Import what any save method imports, so that no method's baseline includes modules."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import megatron_async  # noqa: F401
    import megatron_async.mcore.strategy  # noqa: F401


def save_once(method: SaveMethod, workload: Workload, directory: str, index: int,
              train_step: bool) -> Dict[str, Any]:
    """Save once as a training loop would and return the timings (every rank).

    The save call (the stall), one training step while the write goes on in the background
    (it changes the saved tensors in place), then the wait until the checkpoint is complete.
    """
    method.save(directory, index)
    start = now()
    if train_step:
        workload.train_step()
    train_step_s = now() - start
    method.wait()
    t = method.timings
    return {
        "build_s": t["build_s"],
        "plan_s": t["plan_s"],
        "strategy_plan_s": t["strategy_plan_s"],
        "stage_s": t["stage_s"],
        "stall_s": t["t_stall_end"] - t["t_start"],
        "train_step_s": train_step_s,
        "finalize_s": t["finalize_s"],
        "e2e_s": t["t_end"] - t["t_start"],
        "t_start": t["t_start"],
        "t_stall_end": t["t_stall_end"],
        "write_start": t["write_start"],
        "write_end": t["write_end"],
        "reused_plans": t["reused_plans"],
    }


def variant_job(ctx: RankContext) -> Dict[str, Any]:
    """Run ``payload["saves"]`` saves of ``payload["variant"]`` (every rank).

    Returns this rank's results: its workload size, memory baselines and one record per
    save (see :func:`save_once`, plus memory and bytes on disk).
    """
    payload = ctx.payload
    rank = ctx.rank
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=900))
    root = os.path.join(payload["checkpoint_root"], payload["tag"])
    stamp_dir = os.path.join(root, "_stamps")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(stamp_dir)
    dist.barrier(group=group)

    _import_checkpointing_modules()
    sampler = RssSampler(payload["rss_interval_s"])
    workload = build_workload(payload, rank, ctx.world_size)
    method = build_variant(payload["variant"], payload, workload, stamp_dir)
    gc.collect()
    result: Dict[str, Any] = {
        "rank": rank,
        "num_bytes": workload.num_bytes,
        "tensor_count": workload.tensor_count,
        "rss_base": psutil.Process().memory_info().rss,
        "pss_base": sum(tree_pss_bytes()),
        "status": "ok",
        "reason": "",
        "saves": [],
    }
    try:
        reason = ""
        try:
            method.setup()
        except Unsupported as exc:
            reason = str(exc)
        reason = _agree_on_reason(reason, group)
        if reason:
            result.update(status="unsupported", reason=reason)
            return result
        if payload["variant"] == "ours_persistent" or "persistent" in payload["variant"]:
            result["worker_started"] = wait_for_quiet_children(_WORKER_START_TIMEOUT_S)
        gc.collect()
        result["pss_idle_rank"], result["pss_idle_background"] = tree_pss_bytes()
        result["pss_idle"] = result["pss_idle_rank"] + result["pss_idle_background"]
        sampler.take_peaks()
        previous = None
        for index in range(payload["saves"]):
            directory = os.path.join(root, f"iter_{index:07d}")
            if rank == 0:
                os.makedirs(directory)
            dist.barrier(group=group)
            reason = ""
            try:
                record = save_once(method, workload, directory, index, payload["train_step"])
            except Unsupported as exc:
                reason, record = str(exc), {}
            reason = _agree_on_reason(reason, group)
            if reason:
                result.update(status="unsupported", reason=reason)
                return result
            record["peak_rss"], record["peak_worker_rss"] = sampler.take_peaks()
            gc.collect()
            record["pss_rank"], record["pss_background"] = tree_pss_bytes()
            record["pss_after"] = record["pss_rank"] + record["pss_background"]
            dist.barrier(group=group)
            if rank == 0:
                record["dir_bytes"] = _directory_bytes(directory)
                if previous is not None:
                    shutil.rmtree(previous, ignore_errors=True)
            previous = directory
            result["saves"].append(record)
    finally:
        result["notes"] = list(method.notes)
        try:
            method.close()
        finally:
            sampler.close()
            dist.barrier(group=group)
            if rank == 0 and not payload.get("keep_checkpoints"):
                shutil.rmtree(root, ignore_errors=True)
    result["notes"] = list(method.notes)
    return result
