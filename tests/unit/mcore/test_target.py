"""The checks of a save's target directory, one rank, without a distributed job."""

import logging
import os
from types import SimpleNamespace

import pytest

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_async.errors import CheckpointInProgressError, CheckpointValidationError
from megatron_async.format import COMPLETION_MARKERS
from megatron_async.mcore import target
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy
from megatron_async.core.save_directories import SaveDirectories
from megatron_async.mcore.target import check_save_target


def _strategy(directories: SaveDirectories) -> TorchDistAsyncSaveStrategy:
    """A strategy whose claims go to ``directories``, not to the process's record."""
    strategy = TorchDistAsyncSaveStrategy()
    strategy.directories = directories
    return strategy


def _state():
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}


def _complete(path):
    for name in COMPLETION_MARKERS:
        (path / name).write_text("{}")
    return str(path)


def test_a_missing_target_is_created_and_a_file_is_refused(tmp_path):
    config = TorchDistSaveConfig()
    check_save_target(str(tmp_path / "run" / "iter_0000001"), config, True)  # as Megatron-LM
    assert (tmp_path / "run" / "iter_0000001").is_dir()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointValidationError, match="is not a directory"):
        check_save_target(str(tmp_path / "a-file"), config, True)
    with pytest.raises(CheckpointValidationError, match="rank 0: cannot create the checkpoint directory"):
        check_save_target(str(tmp_path / "a-file" / "iter_1"), config, True)


@pytest.mark.usefixtures("one_rank_group")
def test_a_directory_still_being_written_is_refused(tmp_path):
    directories = SaveDirectories()
    first = _strategy(directories).async_save(_state(), str(tmp_path))
    assert directories.directories() == [str(tmp_path)]
    with pytest.raises(CheckpointInProgressError, match="not finalized yet"):
        _strategy(directories).async_save(_state(), str(tmp_path))
    assert directories.directories() == [str(tmp_path)]  # the refusal kept the first claim
    first.abandon()
    _strategy(directories).async_save(_state(), str(tmp_path)).abandon()
    assert directories.directories() == []


def test_a_complete_checkpoint_is_refused_on_the_coordinator_or_left_for_after_planning(tmp_path):
    path = _complete(tmp_path)
    refusing = TorchDistSaveConfig(overwrite=False)
    assert not check_save_target(path, refusing, False)  # only the coordinator looks
    with pytest.raises(CheckpointValidationError, match="overwrite=False; save into a new directory"):
        check_save_target(path, refusing, True)
    assert check_save_target(path, TorchDistSaveConfig(), True)  # unmarked once planned
    assert all(os.path.exists(os.path.join(path, name)) for name in COMPLETION_MARKERS)


class _FakeStore:
    """An object store holding the completion markers of one prefix."""

    needs_msc = True

    def __init__(self, prefix):
        self.files = {f"{prefix}/{name}" for name in COMPLETION_MARKERS}

    def is_file(self, path):
        return path in self.files

    def remove(self, path):
        present = path in self.files
        self.files.discard(path)
        return present

    def sync_dir(self, path):
        pass


def test_an_object_store_target_needs_use_msc_and_follows_overwrite(monkeypatch):
    url = "msc://profile/run/iter_1"
    store = _FakeStore(url)
    monkeypatch.setattr(target, "storage_for", lambda path: store)
    with pytest.raises(CheckpointValidationError, match="create the strategy with use_msc=True"):
        check_save_target(url, SimpleNamespace(use_msc=False, overwrite=True), True)
    with pytest.raises(CheckpointValidationError, match="overwrite=False; save into a new directory"):
        check_save_target(url, SimpleNamespace(use_msc=True, overwrite=False), True)
    check_save_target(url, SimpleNamespace(use_msc=True, overwrite=True), True)
    assert store.files == set()


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("one_rank_group")
def test_a_target_check_on_a_hung_mount_fails_within_its_bound_and_stops_the_process_saves(
    tmp_path, monkeypatch
):
    """On a hung mount even os.path.exists never returns: the check gives up within half
    the coordination timeout and frees its claim; the check left behind may still finish,
    so no later save of the process starts (restart the job)."""
    import threading
    import time

    from megatron_async.core import save_directories

    directories = SaveDirectories()
    recovered = threading.Event()
    monkeypatch.setattr(save_directories, "coordinator_step_timeout_s", lambda: 0.3)
    real = target.storage_for
    monkeypatch.setattr(target, "storage_for", lambda path: (recovered.wait(), real(path))[1])
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointValidationError, match="checking the save target .* did not return within 0.3s"):
            _strategy(directories).async_save(_state(), str(tmp_path))
        assert time.monotonic() - started < 5
        assert directories.directories() == []
    finally:
        recovered.set()
    monkeypatch.setattr(target, "storage_for", real)
    with pytest.raises(CheckpointInProgressError, match="checking the save target .* restart the job"):
        _strategy(directories).async_save(_state(), str(tmp_path / "other"))


@pytest.mark.usefixtures("one_rank_group")
def test_an_interrupt_during_the_target_check_leaves_nothing_claimed(tmp_path, monkeypatch):
    directories = SaveDirectories()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("megatron_async.mcore.strategy.check_save_target", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _strategy(directories).async_save(_state(), str(tmp_path))
    assert directories.directories() == []
