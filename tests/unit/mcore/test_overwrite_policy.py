"""Overwriting a complete checkpoint: overwrite=False refuses it before anything changes,
common.pt included, through megatron-core's own save() on every generation; the default
overwrites it, unmarking it once every rank agreed the save's planning, so input that
planning refuses leaves it complete where the strategy is the first to touch the directory
(megatron-core 0.19+'s save(), or a direct call: up to 0.18 save() writes common.pt before
the strategy, and its guard unmarks the old checkpoint before that write). One rank."""

import os

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_async.core import AsyncCallsQueue
from megatron_async.errors import CheckpointValidationError
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


def _state(value: float):
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((8,), value))}


def _loaded(path) -> float:
    return float(dist_checkpointing.load(_state(0.0), str(path))["w"][0])


def _files(path):
    return {name: os.path.getmtime(path / name) for name in os.listdir(path)}


def _save_writes_common_pt_first() -> bool:
    """megatron-core 0.16-0.18: save() writes common.pt (behind our guard) before the strategy."""
    from megatron.core.dist_checkpointing import serialization

    from megatron_async.mcore import generation

    save_common = getattr(serialization, "save_common", None)
    return generation.GENERATION == "registry" or getattr(save_common, "__megatron_async_guarded__", False)


def _save_with(strategy, state, path, async_save: bool, **options):
    """Save as a user would where the strategy is the first to touch the directory."""
    if not _save_writes_common_pt_first():
        request = dist_checkpointing.save(
            state, str(path), sharded_strategy=strategy, async_sharded_save=async_save, **options
        )
    elif async_save:
        request = strategy.async_save(state, str(path))
    else:
        request = strategy.save(state, str(path))
    if request is not None:
        request.execute_sync()


def _refusing(wrapped: bool):
    strategy = TorchDistAsyncSaveStrategy(overwrite=False)
    if wrapped:  # Megatron-LM's --ckpt-fully-parallel-save
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        strategy = FullyParallelSaveStrategyWrapper(strategy)
    return strategy


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "fully-parallel"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_overwrite_false_refuses_a_complete_checkpoint_and_changes_nothing(tmp_path, async_save, wrapped):
    dist_checkpointing.save(_state(1.0), str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy())
    before = _files(tmp_path)
    with pytest.raises(CheckpointValidationError, match="overwrite=False"):
        dist_checkpointing.save(
            _state(2.0), str(tmp_path), sharded_strategy=_refusing(wrapped),
            async_sharded_save=async_save,
        )
    assert _files(tmp_path) == before  # common.pt and the markers untouched
    assert _loaded(tmp_path) == 1.0


def test_a_common_pt_write_that_fails_is_raised_through_the_strategys_agreed_check(tmp_path):
    """On 0.16-0.18 rank 0 writes common.pt before the strategy: its failure (an object that
    will not pickle, a full disk) must reach every rank as the strategy's agreed error,
    never rank 0's alone while the others wait in the strategy's first collective."""
    if not _save_writes_common_pt_first():
        pytest.skip("this megatron-core stores the common state in the strategy (0.19+)")
    unpicklable = dict(_state(2.0), hook=lambda: None)
    with pytest.raises(CheckpointValidationError, match="rank 0: .*(pickle|lambda)"):
        dist_checkpointing.save(  # without validation, which would pickle it first
            unpicklable, str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy(),
            validate_access_integrity=False,
        )
    assert not os.path.exists(tmp_path / ".metadata")


def test_the_default_overwrites_a_complete_checkpoint(tmp_path):
    dist_checkpointing.save(_state(1.0), str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy())
    queue = AsyncCallsQueue(persistent=False)
    try:
        request = dist_checkpointing.save(
            _state(3.0), str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy(),
            async_sharded_save=True,
        )
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    assert _loaded(tmp_path) == 3.0


def _overlapping_state(value: float):
    """Two main shards of the same item: the global plan refuses them (on every rank)."""
    return {
        "a": ShardedTensor.from_rank_offsets("w", torch.full((8,), value)),
        "b": ShardedTensor.from_rank_offsets("w", torch.full((8,), value)),
    }


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_refused_while_planning_leaves_the_overwritten_checkpoint_complete(tmp_path, async_save):
    dist_checkpointing.save(_state(1.0), str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy())
    before = _files(tmp_path)
    with pytest.raises(CheckpointValidationError, match="overlapping shards"):
        _save_with(
            TorchDistAsyncSaveStrategy(), _overlapping_state(2.0), tmp_path, async_save,
            validate_access_integrity=False,
        )
    assert _files(tmp_path) == before  # unmarking comes after planning
    assert _loaded(tmp_path) == 1.0


def test_a_process_whose_step_was_left_behind_refuses_the_next_save_and_keeps_common_pt(tmp_path):
    """A step left behind on a hung mount may still land over newer files: the next save
    is refused on every rank before anything changes (on 0.16-0.18 the guard leaves
    common.pt untouched and the strategy's agreed check refuses), whatever the step does
    later, and the message says to restart the job."""
    import threading

    from megatron_async.core.save_directories import FileSystemStepTimeoutError, SaveDirectories
    from megatron_async.errors import CheckpointInProgressError

    path = str(tmp_path)
    dist_checkpointing.save(_state(1.0), path, sharded_strategy=TorchDistAsyncSaveStrategy())
    before = _files(tmp_path)
    recovered = threading.Event()
    with pytest.raises(FileSystemStepTimeoutError):
        SaveDirectories.of_process().run_bounded("writing .metadata (test)", recovered.wait, timeout_s=0.1)
    recovered.set()  # the step returns: the process still saves no more
    for async_save in (False, True):
        with pytest.raises(CheckpointInProgressError, match="writing .metadata \\(test\\) did not return.*restart the job"):
            dist_checkpointing.save(
                _state(2.0), path, sharded_strategy=TorchDistAsyncSaveStrategy(), async_sharded_save=async_save,
            )
        assert _files(tmp_path) == before and _loaded(tmp_path) == 1.0


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_into_a_missing_directory_creates_it(tmp_path, async_save):
    """megatron-core's save() lists the directory on rank 0 before any strategy runs: a
    per-iteration directory that does not exist yet is created first (every generation)."""
    path = tmp_path / "run" / "iter_0000007"
    request = dist_checkpointing.save(
        _state(7.0), str(path), sharded_strategy=TorchDistAsyncSaveStrategy(), async_sharded_save=async_save,
    )
    if request is not None:
        request.execute_sync()
    assert _loaded(path) == 7.0
