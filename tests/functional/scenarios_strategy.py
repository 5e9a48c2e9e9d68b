"""Multi-rank scenarios of the torch_dist async save strategy; run by test_strategy.py.

Every rank runs every scenario (one launch per world size). Checkpoints are read back
through megatron-core's ``dist_checkpointing.load`` and through plain
``torch.distributed.checkpoint.load``. Rank 1 plays the failing rank in fault scenarios.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import errno
import inspect
import io
import logging
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from megatron_async import cli
from megatron_async.integrity import checksums
from megatron_async.integrity.verify import verify_checkpoint_integrity
from megatron_async.mcore import generation
from megatron_async.core import AsyncCallsQueue, coordination
from megatron_async.format import COMMON_FILE, checksum_record_name
from megatron_async.errors import (
    AsyncSaveFailedError,
    CheckpointInProgressError,
    CheckpointValidationError,
)
from megatron_async.writer.filesystem import FileSystemWriterAsync
from megatron_async.staging import overlapped
from megatron_async.core.save_directories import SaveDirectories
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy
from tests.staging_aids import copies_held, staging_in_progress
from tests.functional.harness import (
    RankContext,
    by_name,
    for_both_callers,
    only_selected,
    run_scenarios,
    with_caller,
)

FAILING_RANK = 1

_SAVE_VERIFIES_INTEGRITY = "verify_integrity" in inspect.signature(dist_checkpointing.save).parameters
"""megatron-core 0.18+ can write a SHA-256 manifest after a save."""

_SAVE_WRITES_COMMON_PT = generation.GENERATION == "registry" or callable(
    getattr(importlib.import_module("megatron.core.dist_checkpointing.serialization"), "save_common", None)
)
"""Up to 0.18.x ``save()`` writes ``common.pt``; 0.19+ stores a ``common_state`` object."""


# -- the state dict --------------------------------------------------------------------


def _global_tensors(ws: int, scale: float):
    """Every saved tensor as a whole, deterministic in (world size, scale)."""
    base = torch.arange(ws * 4 * 6, dtype=torch.float32).reshape(ws * 4, 6)
    return {
        "rows": base * scale,  # sharded along axis 0
        "cols": (torch.arange(3 * ws * 2, dtype=torch.float32).reshape(3, ws * 2) * scale).to(
            torch.bfloat16
        ),  # sharded along axis 1
        "stacked": (torch.arange(ws * 2 * 5, dtype=torch.float32).reshape(ws, 2, 5) + scale).to(
            torch.float16
        ),  # one layer per rank on a prepended axis
        "replicated": torch.arange(7, dtype=torch.int64) * int(scale),
        "flags": (torch.arange(ws * 3) % 3 == int(scale) % 3),
        "view": (torch.arange(6 * ws * 2, dtype=torch.float32).reshape(6, ws * 2) * scale).t()
        .contiguous(),  # saved from non-contiguous local views
    }


def _model_state(ctx: RankContext, scale: float, extra_key: bool = False):
    """This rank's megatron-core sharded state dict."""
    r, ws = ctx.rank, ctx.world_size
    g = _global_tensors(ws, scale)
    view_source = g["view"].t().contiguous()  # (6, ws*2); the rank's rows of g["view"] are its columns
    state = {
        "rows": ShardedTensor.from_rank_offsets("rows", g["rows"][r * 4 : (r + 1) * 4].clone(), (0, r, ws)),
        "cols": ShardedTensor.from_rank_offsets("cols", g["cols"][:, r * 2 : (r + 1) * 2].clone(), (1, r, ws)),
        "stacked": ShardedTensor.from_rank_offsets(
            "stacked", g["stacked"][r].clone(), (0, r, ws), prepend_axis_num=1
        ),
        "replicated": ShardedTensor.from_rank_offsets(
            "replicated", g["replicated"].clone(), replica_id=r
        ),
        "flags": ShardedTensor.from_rank_offsets("flags", g["flags"][r * 3 : (r + 1) * 3].clone(), (0, r, ws)),
        "view": ShardedTensor.from_rank_offsets(
            "view", view_source[:, r * 2 : (r + 1) * 2].t(), (0, r, ws)
        ),
        "obj": ShardedObject("obj", {"rank": r, "scale": scale}, (ws,), (r,), replica_id=0),
        "common_value": scale,
    }
    if extra_key:
        state["added"] = ShardedTensor.from_rank_offsets(
            "added", torch.full((2,), float(scale)), replica_id=r
        )
    return state


def _unwrap(value):
    return value.data if isinstance(value, (ShardedTensor, ShardedObject)) else value


def _assert_equal_states(loaded, expected, where: str) -> None:
    assert set(loaded) == set(expected), (where, sorted(loaded), sorted(expected))
    for key, exp in expected.items():
        got, exp = loaded[key], _unwrap(exp)
        if isinstance(exp, torch.Tensor):
            assert got.dtype == exp.dtype and got.shape == exp.shape, (where, key, got, exp)
            assert torch.equal(got, exp), (where, key, got, exp)
        else:
            assert got == exp, (where, key, got, exp)


def _load_megatron(ctx, path, scale_template=0.0, extra_key=False):
    """Load with stock megatron-core (its torch_dist loader, gloo, CPU)."""
    return dist_checkpointing.load(_model_state(ctx, scale_template, extra_key), path)


def _load_dcp(path, ws: int, reader_type=dcp.FileSystemReader):
    """Load every tensor whole, and every object, with plain PyTorch DCP (and ``reader_type``)."""
    metadata = reader_type(path).read_metadata()
    state = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            state[key] = io.BytesIO()
        else:
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(state, storage_reader=reader_type(path))
    return state


def _check_checkpoint(ctx, path, scale, extra_key=False) -> None:
    """The checkpoint at ``path`` holds exactly the state of ``scale``, for both loaders."""
    expected = _model_state(ctx, scale, extra_key)
    _assert_equal_states(_load_megatron(ctx, path, extra_key=extra_key), expected, "megatron")
    loaded = _load_dcp(path, ctx.world_size)
    for key, tensor in _global_tensors(ctx.world_size, scale).items():
        assert torch.equal(loaded[key], tensor), ("dcp", key)
    objects = sorted(k for k in loaded if k.startswith("obj/"))
    assert len(objects) == ctx.world_size, objects
    with open(os.path.join(path, "metadata.json")) as stream:
        assert '"torch_dist"' in stream.read()


def _dir(ctx: RankContext, name: str) -> str:
    path = os.path.join(ctx.tmp_dir, name)
    if ctx.rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def _save_async(queue, ctx, path, strategy, scale, extra_key=False, mutate=False, **save_kwargs):
    state = _model_state(ctx, scale, extra_key)
    request = dist_checkpointing.save(
        state, path, sharded_strategy=strategy, async_sharded_save=True, **save_kwargs
    )
    queue.schedule_async_request(request)
    if mutate:  # the trainer's next step, right after scheduling returns
        for value in state.values():
            if not isinstance(value, ShardedTensor) or not value.data.numel():
                continue
            if value.data.dtype == torch.bool:
                value.data.logical_not_()
            else:
                value.data.add_(1000)
    queue.maybe_finalize_async_calls(blocking=True)


# -- scenarios -------------------------------------------------------------------------

_QUEUES = {}


def _queue(persistent: bool) -> AsyncCallsQueue:
    """One queue of each kind per launch: the persistent worker starts once."""
    if persistent not in _QUEUES:
        _QUEUES[persistent] = AsyncCallsQueue(persistent=persistent)
    return _QUEUES[persistent]


def sync_save_round_trip(ctx):
    path = _dir(ctx, "sync")
    dist_checkpointing.save(_model_state(ctx, 2.0), path, sharded_strategy=TorchDistAsyncSaveStrategy())
    _check_checkpoint(ctx, path, 2.0)


def async_equals_sync(ctx, persistent):
    path = _dir(ctx, f"async-{persistent}")
    _save_async(_queue(persistent), ctx, path, TorchDistAsyncSaveStrategy(), 2.0)
    _check_checkpoint(ctx, path, 2.0)
    ours, reference = _load_dcp(path, ctx.world_size), _load_dcp(_dir(ctx, "sync"), ctx.world_size)
    assert set(ours) == set(reference)
    for key in ours:
        if isinstance(ours[key], torch.Tensor):
            assert torch.equal(ours[key], reference[key]), key
        else:
            assert ours[key] == reference[key], key


def in_place_updates_after_schedule_are_not_saved(ctx, persistent):
    path = _dir(ctx, f"snapshot-{persistent}")
    _save_async(_queue(persistent), ctx, path, TorchDistAsyncSaveStrategy(), 3.0, mutate=True)
    _check_checkpoint(ctx, path, 3.0)


def _gathers_per_save(ctx, persistent, strategy, name, steps):
    """Save ``steps`` ((scale, extra_key) each) in turn; check each; count plan gathers."""
    gathered = []
    for step, (scale, extra_key) in enumerate(steps):
        path = _dir(ctx, f"{name}-{step}")
        before = coordination.gather_count("plan")
        _save_async(_queue(persistent), ctx, path, strategy, scale, extra_key)
        gathered.append(coordination.gather_count("plan") - before)
        _check_checkpoint(ctx, path, scale, extra_key)
    return gathered


def cached_metadata_skips_plan_gathers(ctx, persistent):
    strategy = TorchDistAsyncSaveStrategy(cached_metadata=True)
    steps = [(float(i + 1), i >= 3) for i in range(5)]
    gathered = _gathers_per_save(ctx, persistent, strategy, f"cached-{persistent}", steps)
    # First save plans; the structure is then verified unchanged and reused (the third
    # save gathers nothing); the added key forces a fresh plan, reused again afterwards.
    assert gathered == [1, 0, 0, 1, 0], gathered


def _state_changed_on_rank_1(ctx, scale, changes):
    """``_model_state`` with structural ``changes`` on rank 1 only (others keep theirs).

    "tensor" adds a tensor only rank 1 holds, "wide" widens it, "object" adds a
    ShardedObject of rank 1, "replica" gives rank 1's copy of "replicated" another
    non-main replica id (which changes no plan), "payload" makes rank 1's object larger
    (the same plan, other storage offsets on rank 1).
    """
    state = _model_state(ctx, scale)
    if ctx.rank != FAILING_RANK:
        return state
    if "tensor" in changes:
        length = 5 if "wide" in changes else 3
        state["only1"] = ShardedTensor.from_rank_offsets("only1", torch.full((length,), scale))
    if "object" in changes:
        state["obj1"] = ShardedObject("obj1", {"scale": scale}, (1,), (0,), replica_id=0)
    if "replica" in changes:
        state["replicated"].replica_id = ctx.world_size + 1
    if "payload" in changes:  # same plan, but rank 1's object takes more bytes
        state["obj"] = ShardedObject(
            "obj", {"rank": ctx.rank, "scale": scale, "payload": "x" * 100}, (ctx.world_size,),
            (ctx.rank,), replica_id=0,
        )
    return state


def _check_rank_1_change(ctx, path, scale, changes, step):
    """The checkpoint of ``_state_changed_on_rank_1`` loads equal through megatron-core and
    DCP; returns what DCP loaded."""
    expected_state = _state_changed_on_rank_1(ctx, scale, changes)
    loaded = dist_checkpointing.load(_state_changed_on_rank_1(ctx, 0.0, changes), path)
    _assert_equal_states(loaded, expected_state, f"megatron, step {step}")
    whole = _load_dcp(path, ctx.world_size)
    for key, tensor in _global_tensors(ctx.world_size, scale).items():
        assert torch.equal(whole[key], tensor), ("dcp", step, key)
    return whole


def structure_change_on_one_rank_plans_everywhere(ctx):
    """A structure changed on one rank makes every rank plan (megatron-core's flow)."""
    strategy = TorchDistAsyncSaveStrategy(cached_metadata=True)
    queue = _queue(False)
    # (changes on rank 1, expected (saves reused without planning, plan gathers) per rank)
    steps = [
        ((), (0, 1)),
        ((), (1, 0)),
        (("tensor",), (0, 1)),
        (("tensor",), (1, 0)),
        (("tensor", "wide"), (0, 1)),
        (("tensor", "wide", "object"), (0, 1)),
        (("tensor", "wide", "object"), (1, 0)),
        ((), (0, 1)),
        # Only the fingerprint changed, not the plan: planned everywhere, nothing gathered.
        (("replica",), (0, 0)),
        (("replica",), (1, 0)),
    ]
    for step, (changes, expected) in enumerate(steps):
        scale = float(step + 1)
        path = _dir(ctx, f"one-rank-change-{step}")
        reused, gathered = strategy.plan_cache.structure_reuse_count, coordination.gather_count("plan")
        request = dist_checkpointing.save(
            _state_changed_on_rank_1(ctx, scale, changes),
            path,
            sharded_strategy=strategy,
            async_sharded_save=True,
            validate_access_integrity=step == 0,  # as Megatron-LM's constant-structure saves
        )
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        counts = (
            strategy.plan_cache.structure_reuse_count - reused,
            coordination.gather_count("plan") - gathered,
        )
        assert counts == expected, (step, changes, counts, expected)

        whole = _check_rank_1_change(ctx, path, scale, changes, step)
        if "tensor" in changes:
            assert torch.equal(whole["only1"], torch.full((5 if "wide" in changes else 3,), scale))
        assert ("only1" in whole) == ("tensor" in changes), (step, sorted(whole))
        objects = sorted(k for k in whole if k.startswith("obj"))
        assert len(objects) == ctx.world_size + ("object" in changes), objects


@contextlib.contextmanager
def _counted_object_collectives():
    """Count this rank's gathers of objects (DCP's ``gather_object``, our ``all_gather_object``)."""
    counts = {"gather_object": 0, "all_gather_object": 0}
    originals = {name: getattr(dist, name) for name in counts}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in counts:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def warm_saves_gather_no_write_results(ctx, persistent):
    """A save of an unchanged structure (cached plans) gathers no write results and no
    checksums in its finalization; a structure change on rank 1 only, or an object of
    rank 1 that grew (same plan, its items stored at other offsets), takes the full path
    on every rank. Every checkpoint loads equal through megatron-core and DCP, its
    ``.metadata`` names it, and ``verify`` checks every stored item of it."""
    queue = _queue(persistent)
    strategy = TorchDistAsyncSaveStrategy(cached_metadata=True)
    # (changes on rank 1, whether the finalization gathers the write results): a new plan,
    # or the same plan with rank 1's items stored elsewhere, takes the full path everywhere.
    steps = [
        ((), True), ((), False), ((), False), (("tensor",), True), (("tensor",), False),
        (("tensor", "payload"), True), (("tensor", "payload"), False), (("tensor",), True),
    ]
    for step, (changes, full) in enumerate(steps):
        scale = float(step + 1)
        path = _dir(ctx, f"warm-{persistent}-{step}")
        request = dist_checkpointing.save(
            _state_changed_on_rank_1(ctx, scale, changes), path, sharded_strategy=strategy,
            async_sharded_save=True, validate_access_integrity=step == 0,
        )
        queue.schedule_async_request(request)
        before = coordination.gather_count("results")
        with _counted_object_collectives() as counts:
            queue.maybe_finalize_async_calls(blocking=True)
        gathered = (
            coordination.gather_count("results") - before,
            counts["gather_object"],
            counts["all_gather_object"],
        )
        assert gathered == ((1, 1, 0) if full else (0, 0, 0)), (step, changes, gathered)
        if step == 5:  # the larger object: plans reused, yet rank 1's offsets moved
            assert strategy.plan_cache.last_save_reused_plans, "the payload changed the plan"

        whole = _check_rank_1_change(ctx, path, scale, changes, step)
        assert ("only1" in whole) == ("tensor" in changes), (step, sorted(whole))

        metadata = dcp.FileSystemReader(path).read_metadata()
        assert metadata.storage_meta.checkpoint_id == path, metadata.storage_meta
        records = checksums.read_checksums(path)
        stored = {(i.relative_path, i.offset, i.length) for i in metadata.storage_data.values()}
        assert {(r.file, r.offset, r.length) for r in records} == stored, step
        verify_checkpoint_integrity(path, require_checksums=True)
        if ctx.rank == 0:
            assert cli.main(["verify", path]) == 0
        dist.barrier()


def loaded_metadata_skips_the_first_gather(ctx):
    """A resumed job reuses the metadata of the checkpoint it loaded (megatron-core's flow)."""
    first = _dir(ctx, "resume-from")
    _save_async(_queue(False), ctx, first, TorchDistAsyncSaveStrategy(), 1.5)
    # megatron-core 0.17+ keeps the loaded metadata only when asked to (cache_metadata).
    caches = "cache_metadata" in inspect.signature(TorchDistLoadShardedStrategy).parameters
    load_strategy = TorchDistLoadShardedStrategy(**({"cache_metadata": True} if caches else {}))
    dist_checkpointing.load(_model_state(ctx, 0.0), first, sharded_strategy=load_strategy)
    strategy = TorchDistAsyncSaveStrategy(cached_metadata=True)
    strategy.cached_global_metadata = load_strategy.cached_global_metadata
    gathered = _gathers_per_save(ctx, False, strategy, "resumed", [(2.5, False), (3.5, False)])
    assert gathered == [0, 0], gathered


def all_replicas_with_central_planning(ctx):
    """keep_only_main_replica=False: every replica is planned and DCP deduplicates centrally."""
    strategy = TorchDistAsyncSaveStrategy(keep_only_main_replica=False, cached_metadata=True)
    gathered = _gathers_per_save(ctx, False, strategy, "all-replicas", [(3.5, False), (4.5, False)])
    assert gathered == [1, 0], gathered


def cached_data_structure_and_multiproc_io(ctx, persistent):
    strategy = TorchDistAsyncSaveStrategy(
        use_cached_data_structure=True, is_multiproc_io=True, thread_count=3
    )
    for step in range(3):
        path = _dir(ctx, f"cachedds-{persistent}-{step}")
        _save_async(_queue(persistent), ctx, path, strategy, float(step + 5), mutate=True)
        _check_checkpoint(ctx, path, float(step + 5))


def separation_hint_files(ctx):
    path = _dir(ctx, "hint")
    strategy = TorchDistAsyncSaveStrategy(separation_hint="rows", thread_count=1)
    _save_async(_queue(False), ctx, path, strategy, 4.0)
    _check_checkpoint(ctx, path, 4.0)
    names = os.listdir(path)
    assert f"rows__{ctx.rank}_1.distcp" in names and f"__{ctx.rank}_0.distcp" in names, names


def fully_parallel_wrapper(ctx):
    path = _dir(ctx, "fully-parallel")
    strategy = FullyParallelSaveStrategyWrapper(TorchDistAsyncSaveStrategy())
    _save_async(_queue(False), ctx, path, strategy, 6.0)
    _check_checkpoint(ctx, path, 6.0)


def a_rank_with_nothing_to_write(ctx):
    path = _dir(ctx, "nothing")
    rep = torch.arange(5.0)
    state = {"rep": ShardedTensor.from_rank_offsets("rep", rep.clone(), replica_id=ctx.rank)}
    if ctx.rank == 0:
        state["only0"] = ShardedObject("only0", {"x": 1}, (1,), (0,), replica_id=0)
    queue = _queue(False)
    request = dist_checkpointing.save(state, path, sharded_strategy=TorchDistAsyncSaveStrategy(), async_sharded_save=True)
    assert (request.async_fn is None) == (ctx.rank != 0)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    files = [f for f in os.listdir(path) if f.endswith(".distcp")]
    assert all(f.startswith("__0_") for f in files), files
    template = {"rep": ShardedTensor.from_rank_offsets("rep", torch.zeros(5), replica_id=ctx.rank)}
    assert torch.equal(dist_checkpointing.load(template, path)["rep"], rep)


def empty_tensors(ctx):
    # megatron-core's sharding validation divides by the local shape (ZeroDivisionError on
    # rank 0 only, for any tensor with a zero-sized dimension), so it is switched off here,
    # for the save and for the load alike.
    path = _dir(ctx, "empty")
    r, ws = ctx.rank, ctx.world_size

    def state(fill: float):
        return {
            "empty": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 4), replica_id=r),
            "empty_rows": ShardedTensor.from_rank_offsets("empty_rows", torch.zeros(3, 0), (0, r, ws)),
            "w": ShardedTensor.from_rank_offsets("w", torch.full((2,), fill), (0, r, ws)),
        }

    request = dist_checkpointing.save(
        state(1.0),
        path,
        sharded_strategy=TorchDistAsyncSaveStrategy(),
        async_sharded_save=True,
        validate_access_integrity=False,
    )
    queue = _queue(False)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    loaded = dist_checkpointing.load(state(0.0), path, validate_access_integrity=False)
    assert loaded["empty"].shape == (0, 4) and loaded["empty_rows"].shape == (3, 0)
    assert torch.equal(loaded["w"], torch.ones(2))
    whole = _load_dcp(path, ws)
    assert whole["empty"].shape == (0, 4) and whole["empty_rows"].shape == (3 * ws, 0)


def _uneven_shard(key, whole, sizes, rank):
    """``rank``'s shard of ``whole`` split along axis 0 into ``sizes`` (zeros allowed).

    An uneven split has no regular grid, so megatron-core leaves its validation to DCP.
    """
    offset, length = sum(sizes[:rank]), sizes[rank]
    data = whole[offset : offset + length].clone()
    return ShardedTensor(
        key, data, data.dtype, tuple(data.shape), tuple(whole.shape),
        (offset,) + (0,) * (whole.dim() - 1), None,
    )


def _uneven_state(ctx, scale: float):
    """Tensors split unevenly, the way distributed optimizer buckets and MoE experts are.

    * "tail": the first half of the ranks share 30 elements; the others hold nothing, at
      offset 30 (at 4 ranks two empty shards at one offset);
    * "head": rank 0 holds nothing, at offset 0, where the next rank's data starts;
    * "rows": 2-D, rows split like "tail": empty (0, 4) shards at offset (30, 0).
    """
    r, ws = ctx.rank, ctx.world_size
    holders = max(1, ws // 2)
    tail = [30 // holders + (i < 30 % holders) if i < holders else 0 for i in range(ws)]
    head = [0] + [30 // (ws - 1) + (i < 30 % (ws - 1)) for i in range(ws - 1)]
    whole = _uneven_tensors(scale)
    return {
        "tail": _uneven_shard("tail", whole["tail"], tail, r),
        "head": _uneven_shard("head", whole["head"], head, r),
        "rows": _uneven_shard("rows", whole["rows"], tail, r),
    }


def _uneven_tensors(scale: float):
    return {
        "tail": torch.arange(30, dtype=torch.float32) * scale,
        "head": torch.arange(30, dtype=torch.int64) - int(scale),
        "rows": torch.arange(120, dtype=torch.float32).reshape(30, 4) + scale,
    }


def _check_uneven_checkpoint(ctx, path, scale) -> None:
    """Both loaders read the split back, the metadata lists each chunk once, verify passes."""
    expected = _uneven_state(ctx, scale)
    loaded = dist_checkpointing.load(_uneven_state(ctx, 0.0), path)
    _assert_equal_states(loaded, expected, "megatron")
    whole = _load_dcp(path, ctx.world_size)
    for key, tensor in _uneven_tensors(scale).items():
        assert torch.equal(whole[key], tensor), ("dcp", key)
    metadata = dcp.FileSystemReader(path).read_metadata()
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):  # megatron-core 0.17+'s common_state object
            continue
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        assert len(set(offsets for offsets, _ in chunks)) == len(chunks), (key, chunks)
        assert all(MetadataIndex(key, offsets) in metadata.storage_data for offsets, _ in chunks)
    empty = [c for c in metadata.state_dict_metadata["tail"].chunks if not c.sizes.numel()]
    assert [tuple(c.offsets) for c in empty] == [(30,)], empty  # one zero-size chunk
    head = metadata.state_dict_metadata["head"].chunks
    assert all(c.sizes.numel() for c in head), head  # the empty one is covered by data
    records = checksums.read_checksums(path)
    assert len(records) == len(metadata.storage_data), (len(records), len(metadata.storage_data))
    verify_checkpoint_integrity(path, require_checksums=True)
    if ctx.rank == 0:
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            assert cli.main(["verify", path]) == 0, report.getvalue()
        assert report.getvalue().startswith("INTACT"), report.getvalue()


def empty_shards_of_uneven_splits(ctx, persistent):
    """Zero-length shards at one offset on several ranks save and load as with megatron-core.

    Planned in full, with the cached structure (the later saves skip planning), and
    centrally (every replica planned, DCP deduplicates).
    """
    queue = _queue(persistent)
    # (options, saves, saves expected to skip planning)
    variants = [
        ({}, 1, 0),
        ({"cached_metadata": True, "use_cached_data_structure": True}, 3, 2),
        ({"keep_only_main_replica": False}, 1, 0),
    ]
    for variant, (options, saves, unplanned) in enumerate(variants):
        strategy = TorchDistAsyncSaveStrategy(**options)
        for step in range(saves):
            scale = float(step + 2)
            path = _dir(ctx, f"uneven-{persistent}-{variant}-{step}")
            request = dist_checkpointing.save(
                _uneven_state(ctx, scale), path, sharded_strategy=strategy, async_sharded_save=True
            )
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            _check_uneven_checkpoint(ctx, path, scale)
        reused = strategy.plan_cache.structure_reuse_count
        assert reused == unplanned, (options, reused)


def registered_backend(ctx):
    """megatron-core 0.16.x: the strategy is found by its registered backend name."""
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy

    strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, "megatron_async", 1)
    assert isinstance(strategy, TorchDistAsyncSaveStrategy) and strategy.backend == "torch_dist"
    path = _dir(ctx, "registered")
    _save_async(_queue(False), ctx, path, ("megatron_async", 1), 7.0)
    _check_checkpoint(ctx, path, 7.0)


def stock_save_keeps_our_writer(ctx):
    """megatron-core's ``save()`` runs our pipeline, sync and async, on either generation.

    From 0.17 ``save()`` silently replaces a strategy that is not its own kind; only our
    writer leaves the checksum records, so their presence proves which pipeline ran.
    """
    for mode in ("sync", "async"):
        path = _dir(ctx, f"stock-save-{mode}")
        strategy = TorchDistAsyncSaveStrategy()
        state = _model_state(ctx, 3.0)
        if mode == "sync":
            dist_checkpointing.save(state, path, sharded_strategy=strategy)
        else:
            request = dist_checkpointing.save(
                state, path, sharded_strategy=strategy, async_sharded_save=True
            )
            _queue(False).schedule_async_request(request)
            _queue(False).maybe_finalize_async_calls(blocking=True)
        assert os.path.exists(os.path.join(path, checksum_record_name(ctx.rank))), (
            mode, sorted(os.listdir(path))
        )
        assert os.path.exists(os.path.join(path, COMMON_FILE)) == _SAVE_WRITES_COMMON_PT, (
            "common.pt up to 0.18.x; 0.19+ keeps the common state inside the checkpoint"
        )
        _check_checkpoint(ctx, path, 3.0)


def integrity_manifest_on_gloo(ctx, persistent):
    """megatron-core 0.18+'s ``verify_integrity=True``: its manifest step runs after ours,
    agreed on over gloo, and megatron-core's own check accepts the checkpoint."""
    path = _dir(ctx, f"manifest-{persistent}")
    _save_async(_queue(persistent), ctx, path, TorchDistAsyncSaveStrategy(), 4.0, verify_integrity=True)
    assert os.path.exists(os.path.join(path, "integrity.json"))
    loaded = dist_checkpointing.load(_model_state(ctx, 0.0), path, verify_integrity=True)
    _assert_equal_states(loaded, _model_state(ctx, 4.0), "megatron verify_integrity")


def megatron_lm_constant_structure_switch(ctx):
    """Megatron-LM's ``--ckpt-assume-constant-structure`` sets one attribute on the strategy;
    it must mean plan caching and staging-buffer reuse, as in megatron-core."""
    strategy = TorchDistAsyncSaveStrategy()
    strategy.use_cached_ckpt_structure = True
    assert strategy.config.cached_metadata and strategy.config.use_cached_data_structure
    queue = _queue(False)
    for step in range(3):
        path = _dir(ctx, f"constant-structure-{step}")
        _save_async(queue, ctx, path, strategy, 5.0 + step)
        _check_checkpoint(ctx, path, 5.0 + step)
    assert strategy.plan_cache.structure_reuse_count == 2, strategy.plan_cache.structure_reuse_count
    assert strategy.staging_cache.num_bytes() > 0


@contextlib.contextmanager
def _captured_log(name: str, level: int):
    """The records of logger ``name`` at ``level`` and above while the block runs."""
    records = []
    handler = logging.Handler(level)
    handler.emit = records.append
    log = logging.getLogger(name)
    previous = log.level
    log.addHandler(handler)
    log.setLevel(min(level, previous or level))
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(previous)


def stale_checkpoint_detection(ctx, persistent):
    """The same weights saved again into a new checkpoint warn on the coordinator, naming
    both checkpoints, and the stale save is still committed; changed weights are counted in
    the per-save INFO line."""
    queue = _queue(persistent)
    strategy = TorchDistAsyncSaveStrategy()
    strategy.use_cached_ckpt_structure = True
    first, again, changed = (_dir(ctx, f"stale-{persistent}-{n}") for n in range(3))
    with _captured_log("megatron_async.integrity.staleness", logging.WARNING) as warnings, \
            _captured_log("megatron_async.core.queue", logging.INFO) as lines:
        _save_async(queue, ctx, first, strategy, 5.0)
        _save_async(queue, ctx, again, strategy, 5.0)
        _save_async(queue, ctx, changed, strategy, 6.0)
    _check_checkpoint(ctx, again, 5.0)
    messages = [r.getMessage() for r in warnings]
    infos = [r.getMessage() for r in lines]
    if ctx.rank == 0:
        assert len(messages) == 1 and again in messages[0] and first in messages[0], messages
        assert "first save of this job" in infos[0], infos
        assert "0 of " in infos[1] and "items changed since the previous save" in infos[1], infos
        assert "0 of " not in infos[2] and "items changed" in infos[2], infos
    else:
        assert not messages and not any("items changed" in line for line in infos), (messages, infos)


def deep_copy_saves_alternately_with_the_original(ctx, persistent):
    """megatron-core's tests deep-copy a strategy and set ``use_cached_ckpt_structure``:
    the copy, taken after a save, starts with empty caches, and both save in turn (sync
    and async), each reusing only its own plans."""
    queue = _queue(persistent)
    original = TorchDistAsyncSaveStrategy()
    original.use_cached_ckpt_structure = True
    _save_async(queue, ctx, _dir(ctx, f"deepcopy-{persistent}-0"), original, 1.0)
    clone = copy.deepcopy(original)
    assert clone.use_cached_ckpt_structure and clone.plan_cache.structure_reuse_count == 0
    assert clone.staging_cache.num_bytes() == 0
    turns = [(clone, "async"), (original, "sync"), (clone, "sync"), (original, "async"), (clone, "async")]
    for step, (strategy, mode) in enumerate(turns, start=1):
        path, scale = _dir(ctx, f"deepcopy-{persistent}-{step}"), float(step + 1)
        if mode == "sync":
            dist_checkpointing.save(_model_state(ctx, scale), path, sharded_strategy=strategy)
        else:
            _save_async(queue, ctx, path, strategy, scale)
        _check_checkpoint(ctx, path, scale)
    reused = (original.plan_cache.structure_reuse_count, clone.plan_cache.structure_reuse_count)
    assert reused == (2, 2), reused  # the first save of each plans, the others do not
    assert original.staging_cache.num_bytes() > 0 and clone.staging_cache.num_bytes() > 0
    return reused


class _FailOnRankWriter(FileSystemWriterAsync):
    """A disk that is full on FAILING_RANK."""

    @staticmethod
    def write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs):
        if int(os.environ["RANK"]) == FAILING_RANK:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return FileSystemWriterAsync.write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs)


class _KilledOnRankWriter(FileSystemWriterAsync):
    """The writing process of FAILING_RANK is killed (the OOM killer, an operator)."""

    @staticmethod
    def write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs):
        if int(os.environ["RANK"]) == FAILING_RANK:
            os.kill(os.getpid(), signal.SIGKILL)
        return FileSystemWriterAsync.write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs)


class _StrategyWithWriter(TorchDistAsyncSaveStrategy):
    def __init__(self, writer_cls, **options):
        super().__init__(**options)
        self._writer_cls = writer_cls

    def _create_writer(self, checkpoint_dir):
        return self._writer_cls(checkpoint_dir, thread_count=self.config.thread_count)


def _expect_failure_on_every_rank(ctx, persistent, writer_cls, phase):
    previous = _dir(ctx, f"before-fault-{writer_cls.__name__}-{persistent}")
    queue = _queue(persistent)
    _save_async(queue, ctx, previous, TorchDistAsyncSaveStrategy(), 8.0)
    path = _dir(ctx, f"fault-{writer_cls.__name__}-{persistent}")
    failures = None
    try:
        _save_async(queue, ctx, path, _StrategyWithWriter(writer_cls), 9.0)
    except AsyncSaveFailedError as exc:
        failures = {rank: (f.phase, f.message) for rank, f in exc.rank_failures.items()}
    assert failures is not None, "no AsyncSaveFailedError on this rank"
    assert set(failures) == {FAILING_RANK} and failures[FAILING_RANK][0] == phase, failures
    dist.barrier()
    leftovers = set(os.listdir(path)) & {".metadata", "metadata.json"}
    assert not leftovers, f"a failed save left completion markers: {leftovers}"
    _check_checkpoint(ctx, previous, 8.0)
    # The directory is free again and a new save into it succeeds.
    assert path not in SaveDirectories.of_process().directories()
    _save_async(queue, ctx, path, TorchDistAsyncSaveStrategy(), 10.0)
    _check_checkpoint(ctx, path, 10.0)
    return failures


def write_failure_on_one_rank(ctx, persistent):
    failures = _expect_failure_on_every_rank(ctx, persistent, _FailOnRankWriter, "write")
    assert "No space left" in failures[FAILING_RANK][1]


def killed_worker_on_one_rank(ctx, persistent):
    failures = _expect_failure_on_every_rank(ctx, persistent, _KilledOnRankWriter, "worker")
    assert "signal 9" in failures[FAILING_RANK][1], failures


def _expect_error_everywhere(error_type, fn, text):
    try:
        fn()
    except error_type as exc:
        assert text in str(exc), str(exc)
        return
    raise AssertionError(f"no {error_type.__name__} on this rank")


def bad_inputs(ctx):
    strategy = TorchDistAsyncSaveStrategy()
    state = {k: v for k, v in _model_state(ctx, 1.0).items() if k != "common_value"}
    a_file = os.path.join(ctx.tmp_dir, "a-file")
    if ctx.rank == 0:
        open(a_file, "w").close()
    dist.barrier()
    uncreatable = os.path.join(a_file, "iter_1")  # a missing directory is created, not this
    _expect_error_everywhere(
        CheckpointValidationError, lambda: strategy.async_save(state, uncreatable), "cannot create"
    )
    _expect_error_everywhere(
        CheckpointValidationError, lambda: strategy.async_save(state, a_file), "not a directory"
    )
    # The same directory under megatron-core's fully parallel wrapper, whose collectives
    # come before our strategy's: rank 0's failure reaches every rank, no rank waits.
    started = time.monotonic()
    _expect_error_everywhere(
        CheckpointValidationError,
        lambda: dist_checkpointing.save(
            state, uncreatable, sharded_strategy=FullyParallelSaveStrategyWrapper(strategy)
        ),
        "cannot create",
    )
    assert time.monotonic() - started < 60
    # Every rank claims to own the whole "dup" tensor: overlapping shards.
    overlap = {"dup": ShardedTensor.from_rank_offsets("dup", torch.ones(4))}
    _expect_error_everywhere(
        CheckpointValidationError,
        lambda: strategy.async_save(overlap, _dir(ctx, "overlap")),
        "overlapping",
    )
    # megatron-core's own validation in save() finds the overlap on rank 0 alone, before
    # our strategy: every rank raises rank 0's cause at once, not a timeout on the others.
    started = time.monotonic()
    _expect_error_everywhere(
        CheckpointValidationError,
        lambda: dist_checkpointing.save(overlap, _dir(ctx, "overlap-save"), sharded_strategy=strategy),
        "rank 0: CheckpointingException",
    )
    assert time.monotonic() - started < 60
    # The same under megatron-core's fully parallel wrapper (Megatron-LM's default), whose
    # own collectives come first: megatron-core's validation itself is agreed.
    started = time.monotonic()
    _expect_error_everywhere(
        CheckpointValidationError,
        lambda: dist_checkpointing.save(
            overlap, _dir(ctx, "overlap-fully-parallel"),
            sharded_strategy=FullyParallelSaveStrategyWrapper(strategy),
        ),
        "rank 0: CheckpointingException",
    )
    assert time.monotonic() - started < 60
    # Only rank 0's half of a tensor sharded in two: a missing shard.
    half = {"half": ShardedTensor.from_rank_offsets("half", torch.ones(2), (0, 0, 2), replica_id=ctx.rank)}
    _expect_error_everywhere(
        CheckpointValidationError, lambda: strategy.async_save(half, _dir(ctx, "missing")), "fill"
    )
    # A refused overwrite, when asked for.
    complete = _dir(ctx, "complete")
    dist_checkpointing.save(_model_state(ctx, 1.0), complete, sharded_strategy=strategy)
    _expect_error_everywhere(
        CheckpointValidationError,
        lambda: TorchDistAsyncSaveStrategy(overwrite=False).async_save(state, complete),
        "overwrite=False",
    )


def second_save_into_a_directory_in_flight(ctx):
    path = _dir(ctx, "in-flight")
    queue = _queue(False)
    strategy = TorchDistAsyncSaveStrategy()
    request = dist_checkpointing.save(
        _model_state(ctx, 11.0), path, sharded_strategy=strategy, async_sharded_save=True
    )
    queue.schedule_async_request(request)
    _expect_error_everywhere(
        CheckpointInProgressError,
        lambda: strategy.async_save(_model_state(ctx, 12.0), path),
        "not finalized yet",
    )
    queue.maybe_finalize_async_calls(blocking=True)
    _check_checkpoint(ctx, path, 11.0)
    # Finalized: the directory may be saved into again (a safe overwrite).
    _save_async(queue, ctx, path, strategy, 12.0)
    _check_checkpoint(ctx, path, 12.0)


def _mutate(state) -> None:
    """The trainer's next step: change every saved tensor in place."""
    for value in state.values():
        if isinstance(value, ShardedTensor) and value.data.numel():
            if value.data.dtype == torch.bool:
                value.data.logical_not_()
            else:
                value.data.add_(1000)


def overlapped_staging_update_after_the_guard(ctx, persistent):
    """Overlapped staging: scheduling returns before the copy; an in-place update right
    after the guarded point (the wait an optimizer step makes) leaves the checkpoint
    equal to the state at scheduling."""
    queue = _queue(persistent)
    strategy = TorchDistAsyncSaveStrategy(overlap_staging=True, cached_metadata=True,
                                          use_cached_data_structure=True)
    for scale in (4.0, 5.0):  # the second save reuses the plans and staging buffers
        path = _dir(ctx, f"overlapped-{persistent}-{scale}")
        state = _model_state(ctx, scale)
        request = dist_checkpointing.save(state, path, sharded_strategy=strategy,
                                          async_sharded_save=True)
        with copies_held():
            queue.schedule_async_request(request)
            assert staging_in_progress()  # nothing was copied while scheduling
        overlapped.wait_for_staging()
        _mutate(state)
        queue.maybe_finalize_async_calls(blocking=True)
        _check_checkpoint(ctx, path, scale)
    assert strategy.plan_cache.last_save_reused_plans


def overlapped_staging_unguarded_update_fails_everywhere(ctx, persistent):
    """An in-place update on one rank before the copy ran fails the save on every rank,
    naming the tensor, and marks nothing complete."""
    path = _dir(ctx, f"overlapped-race-{persistent}")
    queue = _queue(persistent)
    state = _model_state(ctx, 6.0)
    request = dist_checkpointing.save(state, path, sharded_strategy=TorchDistAsyncSaveStrategy(
        overlap_staging=True), async_sharded_save=True)
    with copies_held():
        queue.schedule_async_request(request)
        if ctx.rank == FAILING_RANK:
            _mutate(state)
    expect_staging_race_everywhere(queue, path, "rows")


def expect_staging_race_everywhere(queue, path, tensor_name):
    """Finalize a save that FAILING_RANK raced (an in-place update before the overlapped
    copy): every rank raises AsyncSaveFailedError naming that rank's StagingRaceError and
    the tensor, and nothing marks the checkpoint complete."""
    failures = None
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except AsyncSaveFailedError as exc:
        failures = dict(exc.rank_failures)
    assert failures is not None, "no AsyncSaveFailedError on this rank"
    assert set(failures) == {FAILING_RANK}, failures
    failure = failures[FAILING_RANK]
    assert failure.exception_type.endswith("StagingRaceError"), failure
    assert f"saved tensor {tensor_name!r}" in failure.message, failure.message
    assert "wait_for_staging()" in failure.message, failure.message
    dist.barrier()
    assert not set(os.listdir(path)) & {".metadata", "metadata.json"}


def _timed(fn):
    """Make a scenario return its duration in seconds (to keep the launch within budget)."""

    def run(ctx):
        start = time.monotonic()
        fn(ctx)
        return round(time.monotonic() - start, 2)

    return run


SCENARIOS = {
    **by_name(sync_save_round_trip),
    # Both callers: each caller's data path end to end, and what differs by caller: a
    # failed or killed background writer, and write results returned from another
    # process (warm saves).
    **for_both_callers(
        async_equals_sync,
        cached_data_structure_and_multiproc_io,
        write_failure_on_one_rank,
        killed_worker_on_one_rank,
        warm_saves_gather_no_write_results,
    ),
    # One caller: both stage in the trainer and plan in the trainer the same way.
    **with_caller(
        "temporal",
        in_place_updates_after_schedule_are_not_saved,
        overlapped_staging_unguarded_update_fails_everywhere,
        stale_checkpoint_detection,
    ),
    **with_caller(
        "persistent",
        cached_metadata_skips_plan_gathers,
        empty_shards_of_uneven_splits,
        overlapped_staging_update_after_the_guard,
        deep_copy_saves_alternately_with_the_original,
    ),
    **by_name(
        structure_change_on_one_rank_plans_everywhere,
        loaded_metadata_skips_the_first_gather,
        all_replicas_with_central_planning,
        separation_hint_files,
        fully_parallel_wrapper,
        a_rank_with_nothing_to_write,
        empty_tensors,
        bad_inputs,
        second_save_into_a_directory_in_flight,
    ),
    **by_name(stock_save_keeps_our_writer, megatron_lm_constant_structure_switch),
    **(by_name(registered_backend) if generation.GENERATION == "registry" else {}),
    **(with_caller("persistent", integrity_manifest_on_gloo) if _SAVE_VERIFIES_INTEGRITY else {}),
}

FOUR_RANK_SCENARIOS = [
    name for name in SCENARIOS if name in (
        "empty_shards_of_uneven_splits[persistent]",
        "a_rank_with_nothing_to_write",
        "all_replicas_with_central_planning",
        "structure_change_on_one_rank_plans_everywhere",
        "fully_parallel_wrapper",
        "warm_saves_gather_no_write_results[persistent]",
        "write_failure_on_one_rank[persistent]",
        "killed_worker_on_one_rank[temporal]",
    )
]
"""The scenarios also run on 4 ranks: those where the rank count is what is tested (uneven
splits, ranks with nothing or only replicas to write, one rank that differs from several,
gathers over more than two ranks)."""


def run_all(ctx: RankContext):
    if ctx.options.get("dump_after_s"):
        import faulthandler

        faulthandler.dump_traceback_later(ctx.options["dump_after_s"], exit=False)
    try:
        return run_scenarios(ctx, {k: _timed(v) for k, v in only_selected(ctx, SCENARIOS).items()})
    finally:
        for queue in _QUEUES.values():
            queue.close(abort=True)
