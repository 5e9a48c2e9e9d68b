"""Multi-rank scenarios of the nvidia-resiliency-ext module surface; run by test_nvrx_surface.py.

* code written against ``nvidia_resiliency_ext.checkpointing.async_ckpt`` switched to
  ``megatron_async.nvrx`` by its import prefix (both generations, both callers);
* megatron-core 0.17+'s own stock strategy with ``async_strategy="nvrx"`` (its default)
  after :func:`megatron_async.nvrx.serve_as_nvidia_resiliency_ext` (0.17+ only).

Checkpoints are loaded back through plain DCP and, for the megatron-core ones, through
megatron-core's loader.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megatron_async.format import checksum_record_name
from megatron_async.mcore import generation
from megatron_async.core import coordination
from tests.functional.harness import RankContext, by_name, for_both_callers, run_selected_then_close
from tests.functional.scenarios_strategy import _check_checkpoint, _dir, _model_state

_QUEUES = {}


def _queue(persistent: bool):
    """One queue of each kind per launch, built from the switched import."""
    from megatron_async.nvrx.core import AsyncCallsQueue

    if persistent not in _QUEUES:
        _QUEUES[persistent] = AsyncCallsQueue(persistent=persistent)
    return _QUEUES[persistent]


def _rank_state(ctx: RankContext, scale: float):
    """A plain DCP state dict: every rank owns distinct keys, of uneven sizes."""
    return {
        f"rank{ctx.rank}/weight": torch.arange(8 * (ctx.rank + 1), dtype=torch.float32) * scale,
        f"rank{ctx.rank}/bias": torch.full((3,), scale + ctx.rank, dtype=torch.bfloat16),
    }


def nvrx_modules_switch_by_import(ctx, persistent):
    """The plan / write / finalize sequence as nvidia-resiliency-ext users write it,
    with a :class:`CheckpointMetadataCache`: the later saves reuse the plans."""
    from megatron_async.nvrx.core import AsyncRequest
    from megatron_async.nvrx.filesystem_async import FileSystemWriterAsync
    from megatron_async.nvrx.state_dict_saver import (
        CheckpointMetadataCache,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    cache = CheckpointMetadataCache()
    gathered = []
    for step in range(3):
        path = _dir(ctx, f"nvrx-direct-{persistent}-{step}")
        state = _rank_state(ctx, float(step + 1))
        before = coordination.gather_count("plan")
        writer = FileSystemWriterAsync(path, thread_count=2)
        planned = save_state_dict_async_plan(
            state, writer, None, 0, DefaultSavePlanner(), enable_cache=True, metadata_cache=cache
        )
        assert len(planned) == 3 and planned[0] is writer, planned
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        request = AsyncRequest(
            save_fn,
            save_args,
            [functools.partial(save_state_dict_async_finalize, *planned)],
            preload_fn=preload_fn,
        )
        _queue(persistent).schedule_async_request(request)
        for tensor in state.values():  # the next training step: must not reach the file
            tensor.add_(100)
        _queue(persistent).maybe_finalize_async_calls(blocking=True)
        gathered.append(coordination.gather_count("plan") - before)
        assert cache.validated_cache_reuse == (step > 0), (step, cache.validated_cache_reuse)
        expected = _rank_state(ctx, float(step + 1))
        loaded = {key: torch.zeros_like(value) for key, value in expected.items()}
        dcp.load(loaded, checkpoint_id=path)
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), (step, key)
    assert gathered == [1, 0, 0], gathered


@contextlib.contextmanager
def _default_group_barriers():
    """Record the ``torch.distributed.barrier`` calls on the default group meanwhile."""
    calls, original = [], dist.barrier

    def barrier(group=None, *args, **kwargs):
        if group is None:
            calls.append(traceback.extract_stack(limit=2)[0].name)  # the caller
        return original(group, *args, **kwargs)

    dist.barrier = barrier
    try:
        yield calls
    finally:
        dist.barrier = original


def stock_megatron_through_served_modules(ctx, persistent):
    """megatron-core 0.17+'s own ``TorchDistSaveShardedStrategy`` with its default
    ``async_strategy="nvrx"`` plans, writes and commits through our modules once they are
    served; Megatron-LM's constant-structure switch reuses the plans."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        get_async_strategy,
    )

    from megatron_async.core import AsyncCallsQueue, AsyncRequest
    from megatron_async.nvrx import is_served, serve_as_nvidia_resiliency_ext

    serve_as_nvidia_resiliency_ext()
    serve_as_nvidia_resiliency_ext()  # a second call is a no-op
    assert is_served()
    _, modules = get_async_strategy("nvrx")
    assert modules["AsyncCallsQueue"] is AsyncCallsQueue
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    strategy.use_cached_ckpt_structure = True  # Megatron-LM's --ckpt-assume-constant-structure
    gathered = []
    for step in range(3):
        path = _dir(ctx, f"nvrx-stock-{persistent}-{step}")
        before = coordination.gather_count("plan")
        request = dist_checkpointing.save(
            _model_state(ctx, 6.0 + step), path, sharded_strategy=strategy, async_sharded_save=True
        )
        assert isinstance(request, AsyncRequest), type(request)
        assert type(request.finalize_fns) is list  # megatron-core's own, with its barrier step
        _queue(persistent).schedule_async_request(request)
        with _default_group_barriers() as barriers:
            _queue(persistent).maybe_finalize_async_calls(blocking=True)
        # megatron-core's metadata.json step waits in a default-group barrier (NCCL in a
        # GPU job, unbounded by our coordination timeout); our queue runs the gloo-safe one
        assert barriers == [], barriers
        gathered.append(coordination.gather_count("plan") - before)
        assert os.path.exists(os.path.join(path, checksum_record_name(ctx.rank))), sorted(os.listdir(path))
        _check_checkpoint(ctx, path, 6.0 + step)
    assert gathered == [1, 0, 0], gathered


SCENARIOS = {
    **for_both_callers(nvrx_modules_switch_by_import),
    **(
        for_both_callers(stock_megatron_through_served_modules)
        if generation.GENERATION == "builtin"
        else {}
    ),
}


def run_all(ctx: RankContext):
    return run_selected_then_close(ctx, SCENARIOS, _QUEUES)
