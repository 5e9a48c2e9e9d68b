"""Local checkpoint scenarios with megatron-core's MCoreTensorAwareStateDict, the way
Megatron-LM's ``checkpointing.py`` uses it, one per ``--non-persistent-local-ckpt-algo``
(part of :mod:`tests.functional.scenarios_local`'s launch, every rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.functional.harness import RankContext


def _sharded_state(ctx: RankContext, iteration: int):
    from megatron.core.dist_checkpointing import ShardedTensor

    rank, world = ctx.rank, ctx.world_size
    return {
        "weight": ShardedTensor.from_rank_offsets(
            "weight", torch.full((4, 3), float(10 * iteration + rank)), (0, rank, world)
        ),
        "bias": ShardedTensor.from_rank_offsets(
            "bias", torch.arange(3.0) + iteration, replica_id=rank
        ),
        "iteration": iteration,
    }


def _megatron_core_round_trip(ctx: RankContext, algo: str, group, exchange_algo="broadcast"):
    """megatron-core's MCoreTensorAwareStateDict through the manager the way Megatron-LM's
    checkpointing.py calls it: built from the sharded state with ``algo`` over ``group``
    (its ``parallelization_group``), saved asynchronously twice, then found, loaded twice
    (the common state first) and turned back into the sharded state, the main replicas
    exchanged with ``exchange_algo``."""
    from megatron.core.dist_checkpointing import tensor_aware_state_dict

    assert tensor_aware_state_dict.HAVE_NVRX  # its base is the served TensorAwareStateDict
    from tests.functional.scenarios_local import _manager, _queue  # its launch's queue

    tasd_cls = tensor_aware_state_dict.MCoreTensorAwareStateDict
    root = f"mcore_{algo}"
    manager = _manager(ctx, root)
    finalized = []
    for iteration in (10, 20):
        sharded = _sharded_state(ctx, iteration)
        tasd, _ = tasd_cls.from_state_dict(sharded, algo=algo, parallelization_group=group)
        request = manager.save(tasd, iteration, is_async=True)
        request.add_finalize_fn(lambda done=iteration: finalized.append(done))
        _queue().schedule_async_request(request)
        assert not tasd.is_hollow
    _queue().maybe_finalize_async_calls(blocking=True)
    assert finalized == [10, 20]

    loader = _manager(ctx, root)
    assert loader.find_latest() == 20
    first, ckpt_id = loader.load()  # Megatron-LM's first call: the common state only
    assert ckpt_id == (20, ctx.rank, "")
    assert first.to_state_dict(None, algo=algo, parallelization_group=group) == {"iteration": 20}
    assert loader.find_latest() == 20
    second, _ = loader.load()
    loaded = second.to_state_dict(
        _sharded_state(ctx, 0), algo=algo, exchange_algo=exchange_algo, parallelization_group=group
    )
    assert loaded["iteration"] == 20
    assert torch.equal(loaded["weight"], torch.full((4, 3), float(200 + ctx.rank)))
    assert torch.equal(loaded["bias"], torch.arange(3.0) + 20)


def megatron_core_state_dict_round_trips(ctx: RankContext):
    """Megatron-LM's ``--non-persistent-local-ckpt-algo atomic``: every rank keeps its
    whole state."""
    _megatron_core_round_trip(ctx, "atomic", None)


def megatron_core_state_dict_round_trips_fully_parallel(ctx: RankContext):
    """``fully_parallel``: the ranks holding the same replicas (here every rank holds the
    bias) each keep a share of the main replicas, and the load exchanges them back.
    megatron-core's default exchange (``broadcast``, Megatron-LM's) goes through CUDA
    memory and its load synchronizes the device, so on CPU the exchange gathers objects
    and the synchronization is skipped; the GPT example's two-node test runs the default
    exchange (through its CPU layer), and on a GPU, gpu_checks' step 3b."""
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None  # no device on a CPU-only host
    try:
        _megatron_core_round_trip(ctx, "fully_parallel", dist.group.WORLD, "gather_object")
    finally:
        torch.cuda.synchronize = synchronize
