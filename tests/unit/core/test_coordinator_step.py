"""The coordinator's own file-system steps are bounded (core/coordinator_step.py), and the
commit steps that only rank 0 runs go through that bound (single process: rank 0)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from megatron_async.core import coordination, coordinator_step
from megatron_async.core.coordinator_step import (
    CoordinatorStepTimeoutError,
    DeadlineExpired,
    run_coordinator_step,
    run_with_deadline,
)
from megatron_async.errors import AsyncSaveFailedError, AsyncTimeoutError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def hung_mount():
    """An event a step waits on, as on a mount that stopped answering; set at the end."""
    recovered = threading.Event()
    yield recovered
    recovered.set()  # let the steps left behind end


def test_a_step_returns_its_value_or_raises_its_own_error():
    assert run_with_deadline(lambda: 42, 5, "t") == 42
    with pytest.raises(KeyError, match="mine"):
        run_with_deadline(lambda: {}["mine"], 5, "t")

    def own_timeout():
        raise TimeoutError("the step's own socket timeout")

    with pytest.raises(TimeoutError, match="own socket") as caught:
        run_coordinator_step("a step", own_timeout, timeout_s=5)
    assert not isinstance(caught.value, (DeadlineExpired, AsyncTimeoutError))


def test_a_step_that_never_returns_fails_within_its_bound(hung_mount):
    started = time.monotonic()
    with pytest.raises(CoordinatorStepTimeoutError, match="writing .metadata of /x did not return within 0.3s") as caught:
        run_coordinator_step("writing .metadata of /x", hung_mount.wait, timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert isinstance(caught.value, AsyncTimeoutError)
    assert "check the mount" in str(caught.value)
    left_behind = [t for t in threading.enumerate() if t.name == "save step: writing .metadata of /x"]
    assert left_behind and all(t.daemon for t in left_behind)


def test_the_bound_is_half_the_coordination_timeout(monkeypatch):
    monkeypatch.setattr(coordination, "_cached_timeout_s", 30.0)
    assert coordinator_step.coordinator_step_timeout_s() == 15.0
    assert coordination.coordination_timeout_s() == 30.0


def test_the_tracker_step_of_a_commit_is_bounded(tmp_path, monkeypatch, hung_mount):
    from megatron_async import manager as mgr

    monkeypatch.setattr(coordinator_step, "coordinator_step_timeout_s", lambda: 0.3)
    manager = mgr.CheckpointManager(mgr.CheckpointManagerConfig(save_dir=str(tmp_path)))
    path = manager.prepare_save(1)
    for marker in mgr.COMPLETE_MARKERS:
        (tmp_path / os.path.basename(path) / marker).write_text("{}")
    monkeypatch.setattr(mgr, "write_tracker", lambda *args: hung_mount.wait())
    with pytest.raises(AsyncSaveFailedError, match="marking .* as the latest checkpoint did not return"):
        manager.commit(1)
    assert mgr.read_tracker(str(tmp_path)) is None


def test_megatron_cores_metadata_json_step_is_bounded(tmp_path, monkeypatch, hung_mount):
    from megatron_async.mcore import finalize

    class HungStorage:
        def write_atomically(self, path, data):
            hung_mount.wait()

    monkeypatch.setattr(coordinator_step, "coordinator_step_timeout_s", lambda: 0.3)
    monkeypatch.setattr(finalize, "storage_for", lambda path: HungStorage())
    with pytest.raises(AsyncSaveFailedError, match="metadata.json did not return within 0.3s"):
        finalize.write_megatron_config(str(tmp_path), "torch_dist", 1)
    assert not os.path.exists(tmp_path / "metadata.json")


def test_a_commit_left_behind_does_not_leave_the_collector_paused(tmp_path, monkeypatch, hung_mount):
    import gc

    from torch.distributed.checkpoint.metadata import Metadata

    from megatron_async.writer import commit

    class HungStorage:
        def sync(self, path):
            hung_mount.wait()

    monkeypatch.setattr(coordinator_step, "coordinator_step_timeout_s", lambda: 0.3)
    monkeypatch.setattr(commit, "storage_for", lambda path: HungStorage())
    assert gc.isenabled()
    with pytest.raises(CoordinatorStepTimeoutError, match="writing .metadata of"):
        commit.commit_checkpoint(str(tmp_path), Metadata(state_dict_metadata={}), [[]], None)
    assert gc.isenabled()  # the metadata was built on this thread; only the write was left behind


def _wait_until_returned(path, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while coordinator_step.steps_left_behind(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not coordinator_step.steps_left_behind(path)


def test_a_commit_step_left_behind_keeps_its_directory_taken_until_it_returns(tmp_path, monkeypatch, hung_mount):
    """A late .metadata must never land on a retry's new data: the directory stays taken
    (our strategy's check) while the stuck write runs, and is free once it returned (the
    common.pt guard, which rank 0 alone runs this way: test_rank_stopped_during_finalize)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from megatron_async.errors import CheckpointInProgressError
    from megatron_async.mcore.config import TorchDistSaveConfig
    from megatron_async.mcore.target import check_save_target
    from megatron_async.writer import commit

    class HungStorage:
        def sync(self, path):
            hung_mount.wait()

    target = str(tmp_path)
    monkeypatch.setattr(coordinator_step, "coordinator_step_timeout_s", lambda: 0.3)
    monkeypatch.setattr(commit, "storage_for", lambda path: HungStorage())
    with pytest.raises(CoordinatorStepTimeoutError):
        commit.commit_checkpoint(target, Metadata(state_dict_metadata={}), [[]], None)
    from megatron_async.storage.backend import normalize_checkpoint_path

    assert coordinator_step.steps_left_behind(normalize_checkpoint_path(target + "/")) == [
        f"writing .metadata of {target}"
    ]
    assert coordinator_step.steps_left_behind(str(tmp_path / "other")) == []
    with pytest.raises(CheckpointInProgressError, match="writing .metadata of .* is still running.*check the mount"):
        check_save_target(target, TorchDistSaveConfig(), is_coordinator=True)

    hung_mount.set()  # the mount recovers: the step returns, the directory is free
    _wait_until_returned(target)
    assert check_save_target(target, TorchDistSaveConfig(), is_coordinator=True) is None


def test_a_tracker_write_left_behind_fails_the_next_commit_at_once(tmp_path, monkeypatch, hung_mount):
    """A late tracker write must never name an older checkpoint than a later commit did."""
    from megatron_async import manager as mgr

    monkeypatch.setattr(coordinator_step, "coordinator_step_timeout_s", lambda: 0.3)
    manager = mgr.CheckpointManager(mgr.CheckpointManagerConfig(save_dir=str(tmp_path)))
    for iteration in (1, 2):
        path = manager.prepare_save(iteration)
        for marker in mgr.COMPLETE_MARKERS:
            (tmp_path / os.path.basename(path) / marker).write_text("{}")
    real_write, calls = mgr.write_tracker, []

    def hung_then_recovered(save_dir, iteration):
        calls.append(iteration)
        hung_mount.wait()
        real_write(save_dir, iteration)

    monkeypatch.setattr(mgr, "write_tracker", hung_then_recovered)
    with pytest.raises(AsyncSaveFailedError, match="did not return"):
        manager.commit(1)
    with pytest.raises(AsyncSaveFailedError, match="marking .*iter_0000001 as the latest checkpoint .* is still running"):
        manager.commit(2)
    assert calls == [1]  # refused without touching the mount
    with pytest.raises(AsyncSaveFailedError, match="restart the job if it persists"):
        manager.prepare_save(3)  # refused before the save writes anything

    hung_mount.set()
    _wait_until_returned(os.path.join(str(tmp_path), mgr.TRACKER_FILENAME))
    assert mgr.read_tracker(str(tmp_path)) == 1  # the late write landed, before the next one
    manager.commit(2)
    assert mgr.read_tracker(str(tmp_path)) == 2 and calls == [1, 2]


def test_a_retry_of_an_iteration_whose_commit_step_is_stuck_is_refused(tmp_path, monkeypatch, hung_mount):
    """The manager deletes an unfinished directory before saving the iteration again: not
    while a step left behind may still write into it."""
    from megatron_async import manager as mgr

    manager = mgr.CheckpointManager(mgr.CheckpointManagerConfig(save_dir=str(tmp_path)))
    path = manager.prepare_save(5)
    with pytest.raises(CoordinatorStepTimeoutError):
        run_coordinator_step(f"writing .metadata of {path}", hung_mount.wait, timeout_s=0.2, path=path)
    manager.abandon(5)
    with pytest.raises(AsyncSaveFailedError, match="is still running"):
        manager.prepare_save(5)
    hung_mount.set()
    _wait_until_returned(path)
    assert manager.prepare_save(5) == path


def test_the_manifest_step_may_take_most_of_the_coordination_timeout(tmp_path, monkeypatch, hung_mount):
    """megatron-core's manifest hashes every file: it gets 0.9 of the coordination timeout
    (keeping 10 s of margin, never less than the half the other steps get), still bounded,
    and its message names the hashing."""
    from megatron_async.mcore import finalize

    for timeout_s, bound_s in ((600.0, 540.0), (60.0, 50.0), (12.0, 6.0)):
        monkeypatch.setattr(coordination, "_cached_timeout_s", timeout_s)
        assert finalize.manifest_step_timeout_s() == bound_s
    monkeypatch.setattr(coordination, "_cached_timeout_s", 1.0)
    written = []
    finalize.write_integrity_manifest(str(tmp_path), written.append)
    assert written == [str(tmp_path)]
    with pytest.raises(AsyncSaveFailedError, match="manifest .* did not return within 0.5s: it reads and hashes every file"):
        finalize.write_integrity_manifest(str(tmp_path), lambda d: hung_mount.wait())
