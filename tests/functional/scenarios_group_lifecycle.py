"""Saves and loads interleaved with megatron-core's model-parallel group re-initialization.

Run by test_group_lifecycle.py on 4 gloo ranks in one long-lived launch, the way
Megatron-LM's own unit tests run: every round re-initializes megatron-core's
model-parallel groups with another (tensor, pipeline) split, builds a fresh save
strategy, saves synchronously and asynchronously (both callers), loads the
checkpoints back through megatron-core and PyTorch DCP, and destroys the groups again.
Some rounds also destroy and re-create the default process group (as Megatron-LM's
``Utils.set_world_size`` does when a test needs another world size), so the cached
coordination group must follow the new default group.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing import ShardedTensor

from megatron_async.core import AsyncCallsQueue, AsyncCallerConfig, coordination
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy
from tests.functional.harness import RankContext, by_name, only_selected, run_scenarios

SPLITS = [(1, 1), (2, 1), (2, 2), (4, 1), (1, 4), (1, 2)]
"""(tensor-parallel, pipeline-parallel) sizes that the rounds cycle through on 4 ranks: each
kind of group (tensor, pipeline, data parallel) alone and mixed, with and without data
parallelism. What is tested is the sequence of group creations, not the rank count."""

COORDINATION_TIMEOUT_S = 60.0
"""Short enough that a mismatched coordination group fails the launch instead of hanging it."""


def _sharded_state(scale: float):
    """A tensor-parallel-sharded weight, a pipeline-stage layer and a data-parallel replica."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    weight = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3) * scale
    rows = 16 // tp_size
    layers = torch.arange(8 * 5, dtype=torch.float32).reshape(8, 5) + scale
    per_stage = 8 // pp_size
    return {
        "weight": ShardedTensor.from_rank_offsets(
            "weight", weight[tp_rank * rows : (tp_rank + 1) * rows].clone(),
            (0, tp_rank, tp_size), replica_id=(0, pp_rank, dp_rank),
        ),
        "layers": ShardedTensor.from_rank_offsets(
            "layers", layers[pp_rank * per_stage : (pp_rank + 1) * per_stage].clone(),
            (0, pp_rank, pp_size), replica_id=(tp_rank, 0, dp_rank),
        ),
        "step": scale,
    }


def _check(path: str, scale: float) -> None:
    """Both loaders read back exactly the state of ``scale``."""
    expected = _sharded_state(scale)
    loaded = dist_checkpointing.load(_sharded_state(0.0), path)
    for key in ("weight", "layers"):
        assert torch.equal(loaded[key], expected[key].data), (path, key)
    assert loaded["step"] == scale
    whole = {
        "weight": torch.empty(16, 3),
        "layers": torch.empty(8, 5),
    }
    dcp.load(whole, checkpoint_id=path)
    assert torch.equal(whole["weight"], torch.arange(48, dtype=torch.float32).reshape(16, 3) * scale)
    assert torch.equal(whole["layers"], torch.arange(40, dtype=torch.float32).reshape(8, 5) + scale)


def _fresh_dir(ctx: RankContext, name: str) -> str:
    path = os.path.join(ctx.tmp_dir, name)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def _reinitialize_world(ctx: RankContext) -> None:
    """Destroy and re-create the default group, as Megatron-LM's test utilities may."""
    parallel_state.destroy_model_parallel()
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", store=store, rank=ctx.rank, world_size=ctx.world_size,
        timeout=timedelta(seconds=COORDINATION_TIMEOUT_S),
    )


def _one_round(ctx: RankContext, index: int, queues) -> int:
    tp, pp = SPLITS[index % len(SPLITS)]
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    strategy = TorchDistAsyncSaveStrategy()
    strategy.use_cached_ckpt_structure = index % 2 == 1
    scale = float(index + 1)

    sync_path = _fresh_dir(ctx, f"round{index}-sync")
    dist_checkpointing.save(_sharded_state(scale), sync_path, sharded_strategy=strategy)
    _check(sync_path, scale)

    queue = queues[index % len(queues)]
    async_path = _fresh_dir(ctx, f"round{index}-async")
    request = dist_checkpointing.save(
        _sharded_state(scale + 0.5), async_path, sharded_strategy=strategy, async_sharded_save=True
    )
    queue.schedule_async_request(request)
    # Megatron-LM re-creates groups while a save is still in the background.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    queue.maybe_finalize_async_calls(blocking=True)
    _check(async_path, scale + 0.5)

    parallel_state.destroy_model_parallel()
    dist.barrier()
    return threading.active_count()


def saves_across_group_reinitialization(ctx: RankContext):
    """Many rounds of re-initialized groups, saves (sync, both callers) and loads."""
    rounds = int(ctx.options.get("rounds", len(SPLITS)))
    config = AsyncCallerConfig(coordination_timeout_s=COORDINATION_TIMEOUT_S)
    queues = [AsyncCallsQueue(persistent=False, config=config), AsyncCallsQueue(persistent=True, config=config)]
    threads = []
    try:
        for index in range(rounds):
            if index == rounds // 2:
                _reinitialize_world(ctx)
            threads.append(_one_round(ctx, index, queues))
    finally:
        for queue in queues:
            queue.close(abort=True)
    return {"threads": threads, "group": id(coordination.get_coordination_group())}


def coordination_group_created_at_different_points(ctx: RankContext):
    """Half the ranks create the coordination group before megatron-core's groups, half after.

    In a fresh default group, even ranks construct their queue (which creates the
    coordination group) before ``initialize_model_parallel``, odd ranks after it, as
    happens when ranks reach their first save at different points. Every group must
    still pair the right ranks: megatron-core's groups work, and a save and a load do.
    """
    _reinitialize_world(ctx)
    config = AsyncCallerConfig(coordination_timeout_s=COORDINATION_TIMEOUT_S)
    queue = AsyncCallsQueue(persistent=False, config=config) if ctx.rank % 2 == 0 else None
    parallel_state.initialize_model_parallel(2, 2, distributed_timeout_minutes=1)
    queue = queue or AsyncCallsQueue(persistent=False, config=config)
    try:
        tp_sum = torch.ones(1)
        dist.all_reduce(tp_sum, group=parallel_state.get_tensor_model_parallel_group())
        assert tp_sum.item() == 2, tp_sum
        path = _fresh_dir(ctx, "different-points")
        request = dist_checkpointing.save(
            _sharded_state(3.0), path, sharded_strategy=TorchDistAsyncSaveStrategy(),
            async_sharded_save=True,
        )
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        _check(path, 3.0)
    finally:
        queue.close(abort=True)
        parallel_state.destroy_model_parallel()
    return True


SCENARIOS = by_name(coordination_group_created_at_different_points, saves_across_group_reinitialization)


def run_all(ctx: RankContext):
    return run_scenarios(ctx, only_selected(ctx, SCENARIOS))
