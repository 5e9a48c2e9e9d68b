"""Local checkpoints replicated to peers, on 4 gloo ranks; run by test_local_checkpoints.py.

Replication jump 2 and factor 2: ranks {0, 1} and {2, 3} play two nodes, and the cliques
are (0, 2) and (1, 3), so every part has one replica on the other node. Every holder
directory is under one scenario's root (``root/<rank>``). Saves go through one
persistent ``AsyncCallsQueue`` per launch; every recovery uses fresh managers, as a
restarted job does.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist

from megatron_async.core import AsyncCallsQueue
from megatron_async.core.config import AsyncCallerConfig
from megatron_async.errors import AsyncSaveFailedError, CheckpointingException
from megatron_async.local import recover, transport
from megatron_async.nvrx import serve_as_nvidia_resiliency_ext
from tests.functional.harness import RankContext, by_name, only_selected, run_scenarios
from tests.functional.scenarios_local_mcore import (
    megatron_core_state_dict_round_trips,
    megatron_core_state_dict_round_trips_fully_parallel,
)

JUMP, FACTOR = 2, 2
LOST_NODE = (2, 3)
_QUEUE = {}


def _queue() -> AsyncCallsQueue:
    """One persistent queue per launch (its worker starts once); the first queue of the
    job bounds the coordination group's collectives, and so the exchange's waits."""
    if "queue" not in _QUEUE:
        _QUEUE["queue"] = AsyncCallsQueue(
            persistent=True, config=AsyncCallerConfig(coordination_timeout_s=120.0)
        )
    return _QUEUE["queue"]


def _manager(ctx: RankContext, root: str, **kwargs):
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy,
    )

    strategy = CliqueReplicationStrategy.from_replication_params(JUMP, FACTOR)
    return LocalCheckpointManager(os.path.join(ctx.tmp_dir, root), repl_strategy=strategy, **kwargs)


def _state(rank: int, iteration: int):
    return {
        "w": torch.full((1000,), float(rank * 100 + iteration)),
        "layers": [torch.arange(17, dtype=torch.int64) + rank, {"iteration": iteration}],
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _save_async(manager, state, iteration: int, finalized: list) -> None:
    """Save as Megatron-LM does with ``--async-save``: the request, a finalize step added,
    scheduled at once; then the tensors change (not in the checkpoint)."""
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

    request = manager.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
    request.add_finalize_fn(lambda: finalized.append(iteration))
    _queue().schedule_async_request(request)
    state["w"].add_(1000)


def _recover(ctx: RankContext, root: str, expected_iteration: int, expected_state):
    """A restarted job's recovery: find_latest and load twice, on fresh managers."""
    manager = _manager(ctx, root)
    assert manager.find_latest() == expected_iteration
    assert manager.find_latest() == expected_iteration
    if expected_iteration == -1:
        return None
    first, ckpt_id = manager.load()
    second, _ = manager.load()
    assert ckpt_id == (expected_iteration, ctx.rank, "")
    assert _equal(first.state_dict, expected_state) and _equal(second.state_dict, expected_state)
    return manager._recovered.source


def _holder(ctx: RankContext, root: str, rank: int) -> str:
    return os.path.join(ctx.tmp_dir, root, str(rank))


def _save_three(ctx: RankContext, root: str) -> None:
    manager = _manager(ctx, root)
    finalized = []
    for iteration in (1, 2, 3):
        _save_async(manager, _state(ctx.rank, iteration), iteration, finalized)
        _queue().maybe_finalize_async_calls(blocking=iteration == 3)
    assert finalized == [1, 2, 3]


def saves_are_replicated_and_recover_equal(ctx: RankContext):
    """Async saves, then a synchronous one (written, replicated and finalized in save)."""
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

    _save_three(ctx, "replicated")
    peer = (ctx.rank + JUMP) % ctx.world_size
    manager = _manager(ctx, "replicated")  # knows of no kept iteration: removes nothing yet
    for iteration in (4, 5):
        state = _state(ctx.rank, iteration)
        assert manager.save(BasicTensorAwareStateDict(state), iteration) is None
    names = sorted(os.listdir(_holder(ctx, "replicated", ctx.rank)))
    assert names == sorted(
        f"iter_{iteration:07d}_{owner}_local.{ext}" for iteration in (4, 5)
        for owner in (ctx.rank, peer) for ext in ("json", "pt")
    ), names  # older than 4 (kept when 5 began) removed by 5's writer; the peer's replicas kept
    assert _recover(ctx, "replicated", 5, _state(ctx.rank, 5)) == ctx.rank


def a_part_above_the_staging_budget_streams_to_its_peer_in_rounds(ctx: RankContext):
    """A part of several chunks staged in rounds (12 MiB against a 4 MiB budget): the writer
    streams each round's chunks to its peer as the trainer stages the next one, and a lost
    node recovers every rank's part equal from the replicas."""
    root = "rounds"
    manager = _manager(ctx, root, staging_memory_limit=4 << 20)
    state = {f"t{i}": torch.full((3 << 18,), float(ctx.rank * 10 + i)) for i in range(4)}
    finalized = []
    _save_async(manager, {**state, "w": torch.zeros(1)}, 1, finalized)
    _queue().maybe_finalize_async_calls(blocking=True)
    assert finalized == [1] and manager.staging_stats["rounds"] > 1, manager.staging_stats
    dist.barrier()
    if ctx.rank >= JUMP:  # the second node is lost
        shutil.rmtree(_holder(ctx, root, ctx.rank))
    dist.barrier()
    expected = {**state, "w": torch.zeros(1)}
    assert _recover(ctx, root, 1, expected) == (ctx.rank if ctx.rank < JUMP else ctx.rank - JUMP)


def a_forked_writer_replicates_too(ctx: RankContext):
    """The temporal caller: each save's writer is a forked child with its own store client."""
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

    queue = AsyncCallsQueue(persistent=False)
    try:
        state = BasicTensorAwareStateDict(_state(ctx.rank, 7))
        queue.schedule_async_request(_manager(ctx, "forked").save(state, 7, is_async=True))
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    finally:
        queue.close()
    peer = (ctx.rank + JUMP) % ctx.world_size
    assert f"iter_0000007_{peer}_local.pt" in os.listdir(_holder(ctx, "forked", ctx.rank))
    assert _recover(ctx, "forked", 7, _state(ctx.rank, 7)) == ctx.rank


def a_lost_node_recovers_from_replicas(ctx: RankContext):
    _save_three(ctx, "lost_node")
    dist.barrier()
    if ctx.rank in LOST_NODE:
        shutil.rmtree(_holder(ctx, "lost_node", ctx.rank))
    dist.barrier()
    source = _recover(ctx, "lost_node", 3, _state(ctx.rank, 3))
    expected_source = (ctx.rank + JUMP) % ctx.world_size if ctx.rank in LOST_NODE else ctx.rank
    assert source == expected_source
    # the received part was written back: the next restart reads every part from its owner
    assert f"iter_0000003_{ctx.rank}_local.pt" in os.listdir(_holder(ctx, "lost_node", ctx.rank))
    dist.barrier()
    assert _recover(ctx, "lost_node", 3, _state(ctx.rank, 3)) == ctx.rank


def ranks_that_disagree_on_the_identity_recover_nothing(ctx: RankContext):
    """``algo`` passed on rank 1 only: rank 0's identity decides, and since rank 1's
    differs every rank returns -1 (none waits in a collective the others left)."""
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

    root = "identity"
    _manager(ctx, root).save(BasicTensorAwareStateDict(_state(ctx.rank, 1)), 1)
    disagreeing = _manager(ctx, root, algo="atomic" if ctx.rank == 1 else None)
    assert disagreeing.find_latest() == -1
    assert _recover(ctx, root, 1, _state(ctx.rank, 1)) == ctx.rank  # agreeing again


def a_rank_that_cannot_stage_fails_the_save_everywhere(ctx: RankContext):
    """Rank 1's staging budget is below its largest tensor: save raises the same error on
    every rank before any writer starts, and the previous iteration recovers."""
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

    root = "staging_fails"
    _manager(ctx, root).save(BasicTensorAwareStateDict(_state(ctx.rank, 1)), 1)
    limited = _manager(ctx, root, staging_memory_limit=64 if ctx.rank == 1 else None)
    try:
        limited.save(BasicTensorAwareStateDict(_state(ctx.rank, 2)), 2, is_async=True)
    except AsyncSaveFailedError as exc:
        assert list(exc.failures) == [1], exc.failures
    else:
        raise AssertionError("the save did not fail")
    assert _recover(ctx, root, 1, _state(ctx.rank, 1)) == ctx.rank


def a_writer_that_cannot_write_fails_the_save_everywhere(ctx: RankContext):
    """Rank 3's writer cannot write its part: its peer (rank 1) stops waiting for it at once,
    every rank raises the same error, and the previous iteration recovers."""
    root = "write_fails"
    manager = _manager(ctx, root)
    _save_async(manager, _state(ctx.rank, 1), 1, [])
    _queue().maybe_finalize_async_calls(blocking=True)
    blocked = os.path.join(_holder(ctx, root, 3), "iter_0000002_3_local.dirty.pt")
    if ctx.rank == 3:
        os.makedirs(blocked)  # a directory where the part's dirty file goes
    dist.barrier()
    _save_async(manager, _state(ctx.rank, 2), 2, [])
    try:
        _queue().maybe_finalize_async_calls(blocking=True)
    except AsyncSaveFailedError as exc:
        assert sorted(exc.failures) == [1, 3], exc.failures
        assert "rank 3: its own part failed (StorageWriteError" in str(exc), str(exc)
    else:
        raise AssertionError("the save did not fail")
    if ctx.rank == 3:  # its failure stayed published for rank 1, then went with the save
        key = f"megatron_async/local/{manager._token}/2/{manager._saves}/3"
        store = transport.store_client(*transport.store_address(required=True), 10.0)
        assert not store.check([key])
        os.rmdir(blocked)
    dist.barrier()
    assert _recover(ctx, root, 1, _state(ctx.rank, 1)) == ctx.rank


def _writer_that_dies_mid_exchange(job, staged):
    """Rank 3's writer in the scenario below (a forked child: the patch is its own): it
    writes its part and replicates it, but exits abruptly instead of acknowledging the
    part it received from its peer."""
    from megatron_async.local import part_writer, transport

    send_message = transport.send_message

    def die_before_the_ack(sock, message):
        if message == {"ok": True}:
            os._exit(17)
        send_message(sock, message)

    transport.send_message = die_before_the_ack
    return part_writer.write_local_part(job, staged)


def a_writer_killed_mid_replication_fails_the_save_everywhere(ctx: RankContext):
    """Rank 3's writer dies mid-exchange: its peer (rank 1) fails at once, every rank raises
    nvidia-resiliency-ext's error well within the exchange's bound, the failed iteration's
    files go, and the previous iteration recovers."""
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

    root = "killed"
    manager = _manager(ctx, root)
    queue = AsyncCallsQueue(persistent=False)  # a writer per save: the dead one is not reused
    try:
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(_state(ctx.rank, 1)), 1, is_async=True)
        )
        queue.maybe_finalize_async_calls(blocking=True)
        request = manager.save(BasicTensorAwareStateDict(_state(ctx.rank, 2)), 2, is_async=True)
        if ctx.rank == 3:
            request = request._replace(async_fn=_writer_that_dies_mid_exchange)
        start = time.monotonic()
        queue.schedule_async_request(request)
        try:
            queue.maybe_finalize_async_calls(blocking=True)
        except CheckpointingException as exc:
            assert isinstance(exc, AsyncSaveFailedError)
            assert sorted(exc.failures) == [1, 3], exc.failures
        else:
            raise AssertionError("the save did not fail")
        elapsed_s = time.monotonic() - start
        assert elapsed_s < 60.0, elapsed_s  # the exchange's bound is 120 s: not waited for
    finally:
        queue.close()
    dist.barrier()
    assert _recover(ctx, root, 1, _state(ctx.rank, 1)) == ctx.rank


def _flip_one_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def a_damaged_copy_is_never_loaded(ctx: RankContext):
    """Rank 0's own part damaged: it loads rank 2's replica, and writes it back. Both copies
    damaged: every rank falls back to the older iteration (left beside, as after an
    unfinished finalize)."""
    root = "damaged"
    manager = _manager(ctx, root)
    finalized = []
    _save_async(manager, _state(ctx.rank, 5), 5, finalized)
    _queue().maybe_finalize_async_calls(blocking=True)
    holder = _holder(ctx, root, ctx.rank)
    kept = os.path.join(ctx.tmp_dir, root, f"kept{ctx.rank}")
    shutil.copytree(holder, kept)
    _save_async(manager, _state(ctx.rank, 6), 6, finalized)
    _queue().maybe_finalize_async_calls(blocking=True)
    assert finalized == [5, 6]
    for name in os.listdir(kept):
        shutil.copy(os.path.join(kept, name), os.path.join(holder, name))
    dist.barrier()
    if ctx.rank == 0:
        _flip_one_byte(os.path.join(holder, "iter_0000006_0_local.pt"))
    dist.barrier()
    source = _recover(ctx, root, 6, _state(ctx.rank, 6))
    assert source == (2 if ctx.rank == 0 else ctx.rank)
    dist.barrier()
    assert _recover(ctx, root, 6, _state(ctx.rank, 6)) == ctx.rank  # rank 0's copy written back
    dist.barrier()
    if ctx.rank in (0, 2):
        _flip_one_byte(os.path.join(holder, "iter_0000006_0_local.pt"))
    dist.barrier()
    assert _recover(ctx, root, 5, _state(ctx.rank, 5)) == ctx.rank


def a_move_that_timed_out_leaves_nothing_behind(ctx: RankContext):
    """Rank 2 lost its parts and rank 0 is too slow to send its replica: every rank gives
    up (-1). The next recovery moves the same part between the same ranks, and a save and
    recovery after it work: nothing of the timed-out move stayed posted."""
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

    root = "slow_peer"
    _save_three(ctx, root)
    dist.barrier()
    if ctx.rank == 2:
        shutil.rmtree(_holder(ctx, root, 2))
    dist.barrier()
    isend, timeout_s = recover.dist.isend, recover.coordination.coordination_timeout_s
    try:
        recover.coordination.coordination_timeout_s = lambda: 3.0
        if ctx.rank == 0:
            recover.dist.isend = lambda *args, **kwargs: time.sleep(6.0) or isend(*args, **kwargs)
        assert _manager(ctx, root).find_latest() == -1
    finally:
        recover.dist.isend, recover.coordination.coordination_timeout_s = isend, timeout_s
    loader = _manager(ctx, root)
    assert _recover(ctx, root, 3, _state(ctx.rank, 3)) == (0 if ctx.rank == 2 else ctx.rank)
    assert loader.find_latest() == 3 and loader.recovered_from == ctx.rank  # written back
    assert loader.save(BasicTensorAwareStateDict(_state(ctx.rank, 4)), 4) is None
    assert _recover(ctx, root, 4, _state(ctx.rank, 4)) == ctx.rank

SCENARIOS = by_name(
    saves_are_replicated_and_recover_equal,
    a_part_above_the_staging_budget_streams_to_its_peer_in_rounds,
    a_forked_writer_replicates_too,
    a_lost_node_recovers_from_replicas,
    ranks_that_disagree_on_the_identity_recover_nothing,
    a_rank_that_cannot_stage_fails_the_save_everywhere,
    a_writer_that_cannot_write_fails_the_save_everywhere,
    a_writer_killed_mid_replication_fails_the_save_everywhere,
    a_damaged_copy_is_never_loaded,
    a_move_that_timed_out_leaves_nothing_behind,
    megatron_core_state_dict_round_trips,
    megatron_core_state_dict_round_trips_fully_parallel,
)


def run_all(ctx: RankContext):
    serve_as_nvidia_resiliency_ext()  # before megatron-core's tensor_aware_state_dict is imported
    try:
        return run_scenarios(ctx, only_selected(ctx, SCENARIOS))
    finally:
        if "queue" in _QUEUE:
            _QUEUE.pop("queue").close(abort=True)
