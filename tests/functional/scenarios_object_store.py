"""Async saves to an S3-compatible store on loopback; run by test_object_store.py.

The test process starts the store (tests/object_store.py) and writes the MSC profiles
(``MSC_CONFIG``); every scenario here runs on 2 gloo ranks and saves to ``msc://`` URLs
with ``TorchDistAsyncSaveStrategy(use_msc=True)``. Checkpoints are read back with stock
megatron-core (its MSC support: ``dist_checkpointing.load`` on an ``msc://`` URL; on
0.17+ it is off until ``MultiStorageClientFeature.enable()``, which ``run_all`` calls as
Megatron-LM's ``--enable-msc`` does) and with plain DCP, through multi-storage-client's
``MultiStorageFileSystemReader`` and through PyTorch's ``FsspecReader`` (MSC registers
the ``msc`` protocol with fsspec).

``checkpoint_manager_on_the_store`` runs :class:`CheckpointManager` on an ``msc://``
save directory: the tracker moves in the save's finalize, retention deletes objects,
a failed save leaves the tracker and resume on the previous checkpoint.

The faults hit rank 1 only, through a profile of its own that reaches the same bucket
another way (a proxy that drops the connection mid-upload, a closed port) or not at all
(refused credentials, a bucket that does not exist). Rank 0 saves to the healthy store,
where the completion markers would appear.
"""

from __future__ import annotations

import os
import time

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

from megatron_async import cli
from megatron_async.checkpoint_dirs import is_complete_checkpoint, list_checkpoints, read_tracker
from megatron_async.manager import CheckpointManager, CheckpointManagerConfig
from megatron_async.core import AsyncCallsQueue
from megatron_async.integrity.verify import verify_checkpoint_integrity
from megatron_async.errors import AsyncSaveFailedError, CheckpointValidationError
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy
from megatron_async.staging.overlapped import wait_for_staging
from megatron_async.storage import storage_for
from tests.functional.harness import RankContext, for_both_callers, only_selected, run_scenarios, with_caller
from tests.functional.scenarios_strategy import _assert_equal_states, _global_tensors, _model_state
from tests.functional.scenarios_strategy import _load_dcp as load_with_dcp

PART_BYTES = 5 << 20
BIG_NUMEL = (6 << 20) // 4
"""6 MiB of float32 per rank: more than one part, so every save is a multipart upload."""

_QUEUES = {}


def _queue(persistent: bool) -> AsyncCallsQueue:
    if persistent not in _QUEUES:
        _QUEUES[persistent] = AsyncCallsQueue(persistent=persistent)
    return _QUEUES[persistent]


def _state(ctx: RankContext, scale: float):
    state = _model_state(ctx, scale)
    big = torch.arange(BIG_NUMEL, dtype=torch.float32) * scale + ctx.rank
    state["big"] = ShardedTensor.from_rank_offsets("big", big, (0, ctx.rank, ctx.world_size))
    return state


def _strategy() -> TorchDistAsyncSaveStrategy:
    return TorchDistAsyncSaveStrategy(use_msc=True, object_part_bytes=PART_BYTES, thread_count=2)


def _url(ctx: RankContext, name: str) -> str:
    return f"msc://{ctx.options['profile']}/{ctx.options['run']}/{name}"


def _load_dcp(url: str):
    """Plain DCP through multi-storage-client's reader."""
    from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemReader

    return load_with_dcp(url, None, reader_type=MultiStorageFileSystemReader)


def _load_fsspec(url: str):
    """Plain DCP through PyTorch's fsspec reader (fsspec finds MSC's ``msc`` protocol)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return load_with_dcp(url, None, reader_type=FsspecReader)


def _check_loads_back(ctx: RankContext, url: str, scale: float, fsspec: bool = False) -> None:
    """Stock megatron-core and plain DCP both read the state of ``scale`` back from ``url``."""
    assert is_complete_checkpoint(url), f"{url} is not marked complete"
    expected = _state(ctx, scale)
    loaded = dist_checkpointing.load(_state(ctx, 0.0), url)
    _assert_equal_states(loaded, expected, "megatron")
    whole_big = torch.cat([_state(ctx, scale)["big"].data - ctx.rank + r for r in range(ctx.world_size)])
    for reader, load in (("msc reader", _load_dcp), ("fsspec", _load_fsspec))[: 1 + fsspec]:
        by_dcp = load(url)
        for key, tensor in _global_tensors(ctx.world_size, scale).items():
            assert torch.equal(by_dcp[key], tensor), (reader, key)
        assert torch.equal(by_dcp["big"], whole_big), (reader, "big")


def _save(ctx: RankContext, url: str, scale: float, persistent: bool, mutate: bool = False,
          strategy: Optional[TorchDistAsyncSaveStrategy] = None) -> None:
    state = _state(ctx, scale)
    request = dist_checkpointing.save(
        state, url, sharded_strategy=strategy or _strategy(), async_sharded_save=True
    )
    _queue(persistent).schedule_async_request(request)
    if mutate:  # the trainer's next step, right after scheduling returns
        wait_for_staging()  # as its optimizer step does (overlapped staging only waits here)
        for value in state.values():
            if isinstance(value, ShardedTensor) and value.data.numel() and value.data.is_floating_point():
                value.data.add_(1000.0)
    _queue(persistent).maybe_finalize_async_calls(blocking=True)


# -- scenarios -----------------------------------------------------------------------------


def save_and_load_back(ctx: RankContext, persistent: bool) -> None:
    """Multipart uploads from both ranks; megatron-core and DCP read the state back equal."""
    url = _url(ctx, f"good-{persistent}")
    _save(ctx, url, 1.0, persistent)
    _check_loads_back(ctx, url, 1.0, fsspec=True)
    verify_checkpoint_integrity(url)  # our checksums, re-hashed from the store by every rank
    if ctx.rank == 0:
        assert cli.main(["verify", url]) == 0
        assert cli.main(["inspect", url]) == 0


def snapshot_after_scheduling(ctx: RankContext, persistent: bool) -> None:
    """Tensors changed right after scheduling do not reach the store."""
    url = _url(ctx, f"snapshot-{persistent}")
    _save(ctx, url, 2.0, persistent, mutate=True)
    _check_loads_back(ctx, url, 2.0)


def staged_in_rounds_to_the_store(ctx: RankContext, persistent: bool) -> None:
    """A staging budget of the largest tensor (below the state): uploads stream from the
    pool in rounds, copied by the trainer and then by the overlapped copy thread; the
    checkpoints load back equal and the snapshot holds."""
    for scale, overlap in ((4.0, False), (5.0, True)):
        url = _url(ctx, f"rounds-{persistent}-{overlap}")
        strategy = TorchDistAsyncSaveStrategy(
            use_msc=True, object_part_bytes=PART_BYTES, thread_count=2,
            staging_memory_limit=BIG_NUMEL * 4, overlap_staging=overlap,
        )
        _save(ctx, url, scale, persistent, mutate=True, strategy=strategy)
        _check_loads_back(ctx, url, scale)


def _fault(ctx: RankContext, name: str, faulty_profile: str, persistent: bool, expect: str,
           strategy=None) -> None:
    """Save with rank 1 on ``faulty_profile``: an error on every rank, nothing complete,
    no multipart upload left open, and the previous checkpoint still loads."""
    previous = _url(ctx, f"previous-{persistent}")
    if not is_complete_checkpoint(previous):
        _save(ctx, previous, 3.0, persistent)
    good = _url(ctx, name)
    url = good if ctx.rank != 1 else f"msc://{faulty_profile}/{ctx.options['run']}/{name}"
    # The strategy directly (no common.pt: megatron-core writes that on rank 0 alone,
    # before any strategy runs, so a store that refuses it fails rank 0 only).
    sharded = {k: v for k, v in _state(ctx, 4.0).items() if isinstance(v, (ShardedTensor, ShardedObject))}
    try:
        # A store that cannot be reached at all fails DCP's planning step (it looks for an
        # existing .metadata): a CheckpointValidationError on every rank, nothing written.
        request = (strategy or _strategy()).async_save(sharded, url)
        _queue(persistent).schedule_async_request(request)
        _queue(persistent).maybe_finalize_async_calls(blocking=True)
    except AsyncSaveFailedError as exc:
        assert set(exc.failures) == {1}, exc.failures
        assert expect in str(exc), str(exc)
    except CheckpointValidationError as exc:
        assert "rank 1" in str(exc) and expect in str(exc), str(exc)
    else:
        raise AssertionError(f"rank {ctx.rank}: the save with a faulty store on rank 1 succeeded")
    dist.barrier()
    assert not storage_for(good).is_file(os.path.join(good, ".metadata")), f"{good} has a .metadata"
    assert not is_complete_checkpoint(good)
    _check_loads_back(ctx, previous, 3.0)


def server_stopped_mid_upload(ctx: RankContext, persistent: bool) -> None:
    _fault(ctx, f"dropped-{persistent}", f"dropping_{persistent}", persistent, "Worker failure")


REQUEST_TIMEOUT_S = 3.0


def _stalled_store(ctx: RankContext, fault: str, persistent: bool) -> float:
    """A store that stops answering mid-upload (``silent``) or answers a byte at a time
    (``drip``): the save fails on every rank within the request deadline; returns seconds."""
    strategy = TorchDistAsyncSaveStrategy(
        use_msc=True, object_part_bytes=PART_BYTES, thread_count=2,
        object_request_timeout_s=REQUEST_TIMEOUT_S,
    )
    start = time.monotonic()
    _fault(ctx, f"{fault}-{persistent}", f"{fault}_{persistent}", persistent,
           f"no complete answer within {REQUEST_TIMEOUT_S:.0f}s", strategy=strategy)
    elapsed = time.monotonic() - start
    # One part's deadline, plus the save, the finalize and the previous checkpoint's load.
    assert elapsed < REQUEST_TIMEOUT_S + 40, elapsed
    return elapsed


def store_stops_answering(ctx: RankContext, persistent: bool) -> float:
    return _stalled_store(ctx, "silent", persistent)


def store_drips_bytes(ctx: RankContext, persistent: bool) -> float:
    return _stalled_store(ctx, "drip", persistent)


def endpoint_down(ctx: RankContext, persistent: bool) -> None:
    _fault(ctx, f"down-{persistent}", "down", persistent, "Could not connect to the endpoint")


def credentials_refused(ctx: RankContext, persistent: bool) -> None:
    _fault(ctx, f"badauth-{persistent}", "badauth", persistent, "403")


def missing_bucket(ctx: RankContext, persistent: bool) -> None:
    _fault(ctx, f"nobucket-{persistent}", "nobucket", persistent, "NoSuchBucket")


def _managed_save(ctx, manager, iteration, persistent, faulty_profile=None) -> None:
    """Save ``iteration`` through ``manager``; the tracker moves in the save's finalize."""
    path = manager.prepare_save(iteration)
    url = path
    if faulty_profile is not None and ctx.rank == 1:
        url = path.replace(f"msc://{ctx.options['profile']}/", f"msc://{faulty_profile}/", 1)
    request = dist_checkpointing.save(
        _state(ctx, float(iteration)), url, sharded_strategy=_strategy(), async_sharded_save=True
    )
    manager.attach_commit(request, iteration)
    _queue(persistent).schedule_async_request(request)
    # Until the finalize saw every rank's objects acknowledged, nothing names the new
    # checkpoint: not its markers, not the tracker.
    assert read_tracker(manager.config.save_dir) != iteration
    assert not is_complete_checkpoint(path)
    _queue(persistent).maybe_finalize_async_calls(blocking=True)


def checkpoint_manager_on_the_store(ctx: RankContext, persistent: bool) -> None:
    """Tracker, retention and resume of CheckpointManager on an msc:// save directory."""
    save_dir = _url(ctx, f"managed-{persistent}")
    manager = CheckpointManager(
        CheckpointManagerConfig(save_dir=save_dir, load_dir=save_dir, keep_last_n=2)
    )
    for iteration in (1, 2, 3):
        _managed_save(ctx, manager, iteration, persistent)
        assert read_tracker(save_dir) == iteration
    dist.barrier()  # retention runs on rank 0 after the commit's collective
    assert [c.iteration for c in list_checkpoints(save_dir)] == [2, 3]
    try:
        _managed_save(ctx, manager, 4, persistent, faulty_profile="nobucket")
    except (AsyncSaveFailedError, CheckpointValidationError) as exc:
        assert "NoSuchBucket" in str(exc), str(exc)
        manager.abandon(4)
    else:
        raise AssertionError(f"rank {ctx.rank}: the save with a missing bucket on rank 1 succeeded")
    assert read_tracker(save_dir) == 3
    point = manager.find_resume_point()
    assert (point.iteration, point.reason) == (3, "tracker")
    _check_loads_back(ctx, point.path, 3.0)
    _managed_save(ctx, manager, 5, persistent)
    dist.barrier()
    # The failed save's objects (rank 0's shard) were older than the newest kept: deleted.
    assert [(c.iteration, c.complete) for c in list_checkpoints(save_dir)] == [(3, True), (5, True)]
    assert manager.find_resume_point().iteration == 5
    if ctx.rank == 0:
        assert cli.main(["list", save_dir]) == 0


SCENARIOS = {
    # Both callers: each caller's uploads end to end, and an upload that fails in the
    # background process (a forked child or the persistent worker) is reported by each.
    **for_both_callers(save_and_load_back, server_stopped_mid_upload),
    # One caller: staging, the request bounds and the up-front checks run the same way for
    # both callers.
    **with_caller("temporal", snapshot_after_scheduling, store_drips_bytes),
    **with_caller("persistent", staged_in_rounds_to_the_store, store_stops_answering),
    **with_caller("temporal", endpoint_down, credentials_refused, missing_bucket),
    **with_caller("persistent", checkpoint_manager_on_the_store),
}


def run_all(ctx: RankContext):
    from megatron.core.msc_utils import MultiStorageClientFeature

    MultiStorageClientFeature.enable()  # Megatron-LM's --enable-msc (off by default on 0.17+)
    try:
        return run_scenarios(ctx, only_selected(ctx, SCENARIOS))
    finally:
        for queue in _QUEUES.values():
            queue.close()
