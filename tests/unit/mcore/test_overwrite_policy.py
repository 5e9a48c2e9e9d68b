"""overwrite=False through megatron-core's own save(), on every generation: a complete
checkpoint is refused before anything of it changes, common.pt included (megatron-core up
to 0.18 writes common.pt before it calls the sharded strategy); the default overwrites,
and a save that planning refuses gives the overwritten checkpoint back unchanged."""

import os

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_async.core import AsyncCallsQueue
from megatron_async.errors import CheckpointValidationError, QueueClosedError
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


def _state(value: float):
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((8,), value))}


def _loaded(path) -> float:
    return float(dist_checkpointing.load(_state(0.0), str(path))["w"][0])


def _files(path):
    return {name: os.path.getmtime(path / name) for name in os.listdir(path)}


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
    assert not _set_aside_files(tmp_path)  # the old markers and common.pt are gone


def _set_aside_files(path):
    return [name for name in os.listdir(path) if ".replaced-" in name]


def _overlapping_state(value: float):
    """Two main shards of the same item: the global plan refuses them (on every rank)."""
    return {
        "a": ShardedTensor.from_rank_offsets("w", torch.full((8,), value)),
        "b": ShardedTensor.from_rank_offsets("w", torch.full((8,), value)),
    }


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_refused_while_planning_gives_the_overwritten_checkpoint_back(tmp_path, async_save):
    dist_checkpointing.save(_state(1.0), str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy())
    before = _files(tmp_path)
    with pytest.raises(CheckpointValidationError, match="overlapping shards"):
        dist_checkpointing.save(
            _overlapping_state(2.0), str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy(),
            async_sharded_save=async_save, validate_access_integrity=False,
        )
    assert _files(tmp_path) == before  # markers back, the old common.pt over the new one
    assert _loaded(tmp_path) == 1.0
    assert not _set_aside_files(tmp_path)


def test_a_common_state_that_cannot_be_written_gives_the_overwritten_checkpoint_back(tmp_path):
    """megatron-core writes common.pt before any strategy runs: when that write fails (an
    object pickle refuses), no data file changed and the old checkpoint comes back."""
    dist_checkpointing.save(_state(1.0), str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy())
    before = _files(tmp_path)
    unpicklable = dict(_state(2.0), hook=lambda: None)
    with pytest.raises(Exception, match="pickle|lambda"):
        dist_checkpointing.save(  # without validation, which would pickle it first
            unpicklable, str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy(),
            validate_access_integrity=False,
        )
    assert _files(tmp_path) == before
    assert _loaded(tmp_path) == 1.0
    assert not _set_aside_files(tmp_path)


def test_a_save_past_planning_drops_what_it_set_aside_even_when_it_never_runs(tmp_path):
    dist_checkpointing.save(_state(1.0), str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy())
    request = dist_checkpointing.save(
        _state(2.0), str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy(), async_sharded_save=True,
    )
    assert _set_aside_files(tmp_path)  # kept while the save may still fail in planning
    queue = AsyncCallsQueue(persistent=False)
    queue.close()
    with pytest.raises(QueueClosedError):
        queue.schedule_async_request(request)
    assert not _set_aside_files(tmp_path)
    assert not os.path.exists(tmp_path / ".metadata")  # incomplete: nothing restores it now


@pytest.mark.parametrize("restore", [True, False], ids=["restored", "discarded"])
def test_a_registered_set_aside_no_strategy_takes_is_restored_or_discarded(tmp_path, restore):
    from megatron_async.mcore.set_aside import drop_registered, set_aside, take_set_aside

    for name in (".metadata", "common.pt"):
        (tmp_path / name).write_text(name)
    set_aside(str(tmp_path), (".metadata", "common.pt"), register=True)
    assert sorted(os.listdir(tmp_path)) == sorted(p for p in os.listdir(tmp_path) if ".replaced-" in p)
    drop_registered(str(tmp_path), restore=restore)
    expected = [".metadata", "common.pt"] if restore else []
    assert sorted(os.listdir(tmp_path)) == expected
    assert take_set_aside(str(tmp_path)) is None


def test_a_save_whose_common_pt_rank_0_left_unwritten_is_refused_even_once_the_step_returned(tmp_path, monkeypatch):
    """A commit step left behind on the directory makes rank 0 skip common.pt (on 0.16-0.18);
    if the step returns before the strategy's check, the save must still be refused, not
    committed with the old common.pt."""
    import threading
    import time

    from megatron_async.core import coordinator_step
    from megatron_async.core.coordinator_step import CoordinatorStepTimeoutError
    from megatron_async.errors import CheckpointInProgressError
    from megatron_async.mcore import common_guard

    from megatron.core.dist_checkpointing import serialization

    from megatron_async.mcore import generation

    path = str(tmp_path)
    dist_checkpointing.save(_state(1.0), path, sharded_strategy=TorchDistAsyncSaveStrategy())
    save_common = getattr(serialization, "save_common", None)
    if generation.GENERATION != "registry" and not getattr(save_common, "__megatron_async_guarded__", False):
        pytest.skip("this megatron-core stores the common state in the strategy (0.19+): no guard")
    before = _files(tmp_path)
    recovered = threading.Event()
    with pytest.raises(CoordinatorStepTimeoutError):
        coordinator_step.run_coordinator_step("writing .metadata (test)", recovered.wait, timeout_s=0.1, path=path)
    real_check, allowed = common_guard.check_common_target, []

    def check_then_recover(checkpoint_dir):
        allowed.append(real_check(checkpoint_dir))
        recovered.set()  # the mount recovers between the guard and the strategy
        deadline = time.monotonic() + 10
        while coordinator_step.steps_left_behind(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return allowed[-1]

    monkeypatch.setattr(common_guard, "check_common_target", check_then_recover)
    try:
        with pytest.raises(CheckpointInProgressError, match="common.pt was not written for this save"):
            dist_checkpointing.save(_state(2.0), path, sharded_strategy=TorchDistAsyncSaveStrategy())
    finally:
        recovered.set()
    assert allowed == [False]
    assert _files(tmp_path) == before and _loaded(tmp_path) == 1.0
    dist_checkpointing.save(_state(3.0), path, sharded_strategy=TorchDistAsyncSaveStrategy())
    assert _loaded(tmp_path) == 3.0
