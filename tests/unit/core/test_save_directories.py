"""The one owner of what a process's saves touch (core/save_directories.py): claimed
directories, bounded file-system steps, and the stuck state a step left behind causes
(single process: rank 0)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from megatron_async.core import coordination, save_directories
from megatron_async.core.helper_threads import DeadlineExpired, HelperThreads
from megatron_async.core.save_directories import FileSystemStepTimeoutError, SaveDirectories
from megatron_async.errors import AsyncSaveFailedError, AsyncTimeoutError, CheckpointInProgressError
from megatron_async import checkpoint_dirs
from megatron_async.checkpoint_dirs import read_tracker
from megatron_async.format import COMPLETION_MARKERS

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def hung_mount():
    """An event a step waits on, as on a mount that stopped answering; set at the end."""
    recovered = threading.Event()
    yield recovered
    recovered.set()  # let the steps left behind end


def test_a_step_returns_its_value_or_raises_its_own_error():
    assert HelperThreads.of_process().run(lambda: 42, 5, "t") == 42
    with pytest.raises(KeyError, match="mine"):
        HelperThreads.of_process().run(lambda: {}["mine"], 5, "t")

    def own_timeout():
        raise TimeoutError("the step's own socket timeout")

    with pytest.raises(TimeoutError, match="own socket") as caught:
        SaveDirectories.of_process().run_bounded("a step", own_timeout, timeout_s=5)
    assert not isinstance(caught.value, (DeadlineExpired, AsyncTimeoutError))


def test_a_step_that_never_returns_fails_within_its_bound(hung_mount):
    started = time.monotonic()
    with pytest.raises(FileSystemStepTimeoutError, match="writing .metadata of /x did not return within 0.3s") as caught:
        SaveDirectories.of_process().run_bounded("writing .metadata of /x", hung_mount.wait, timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert isinstance(caught.value, AsyncTimeoutError)
    assert "check the mount" in str(caught.value)
    left_behind = [t for t in threading.enumerate() if t.name == "save step: writing .metadata of /x"]
    assert left_behind and all(t.daemon for t in left_behind)


def test_the_bound_is_half_the_coordination_timeout(monkeypatch):
    monkeypatch.setattr(coordination, "_cached_timeout_s", 30.0)
    assert save_directories.coordinator_step_timeout_s() == 15.0
    assert coordination.coordination_timeout_s() == 30.0


def test_the_tracker_step_of_a_commit_is_bounded(tmp_path, monkeypatch, hung_mount):
    from megatron_async import manager as mgr

    monkeypatch.setattr(save_directories, "coordinator_step_timeout_s", lambda: 0.3)
    manager = mgr.CheckpointManager(mgr.CheckpointManagerConfig(save_dir=str(tmp_path)))
    path = manager.prepare_save(1)
    for marker in COMPLETION_MARKERS:
        (tmp_path / os.path.basename(path) / marker).write_text("{}")
    monkeypatch.setattr(checkpoint_dirs, "write_tracker", lambda *args: hung_mount.wait())
    with pytest.raises(AsyncSaveFailedError, match="marking .* as the latest checkpoint did not return"):
        manager.commit(1)
    assert read_tracker(str(tmp_path)) is None


def test_megatron_cores_metadata_json_step_is_bounded(tmp_path, monkeypatch, hung_mount):
    from megatron_async.mcore import save_call as finalize

    class HungStorage:
        def write_atomically(self, path, data):
            hung_mount.wait()

    monkeypatch.setattr(save_directories, "coordinator_step_timeout_s", lambda: 0.3)
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

    monkeypatch.setattr(save_directories, "coordinator_step_timeout_s", lambda: 0.3)
    monkeypatch.setattr(commit, "storage_for", lambda path: HungStorage())
    assert gc.isenabled()
    with pytest.raises(FileSystemStepTimeoutError, match="writing .metadata of"):
        commit.commit_checkpoint(str(tmp_path), Metadata(state_dict_metadata={}), [[]], None)
    assert gc.isenabled()  # the metadata was built on this thread; only the write was left behind


def test_a_directory_being_written_is_refused_and_free_once_released():
    """The README-loop mistake: a second save into the directory an unfinalized save
    still writes is refused (every rank alike), and allowed once the first one ended."""
    directories = SaveDirectories()
    claim = directories.claim("/ckpt/iter_1")
    assert directories.directories() == ["/ckpt/iter_1"]
    with pytest.raises(CheckpointInProgressError, match="/ckpt/iter_1 is not finalized yet.*one per iteration"):
        directories.claim("/ckpt/iter_1")
    directories.claim("/ckpt/iter_2").release()
    claim.release()
    claim.release()  # idempotent
    directories.claim("/ckpt/iter_1").release()
    assert directories.directories() == []


def test_a_request_dropped_unfinalized_frees_its_directory():
    import gc

    directories = SaveDirectories()

    class Request:
        pass

    request = Request()
    directories.claim("/ckpt/iter_3").release_when_dropped(request)
    del request
    gc.collect()
    assert directories.directories() == []


def test_a_step_left_behind_stops_every_later_save_of_the_process(tmp_path, monkeypatch, hung_mount):
    """A late .metadata or tracker write could land over newer files: once a step is left
    behind, the process saves no more (any directory, the tracker), even after the step
    returned, and the message says to restart the job."""
    from torch.distributed.checkpoint.metadata import Metadata

    from megatron_async import manager as mgr
    from megatron_async.writer import commit

    class HungStorage:
        def sync(self, path):
            hung_mount.wait()

    monkeypatch.setattr(save_directories, "coordinator_step_timeout_s", lambda: 0.3)
    monkeypatch.setattr(commit, "storage_for", lambda path: HungStorage())
    with pytest.raises(FileSystemStepTimeoutError):
        commit.commit_checkpoint(str(tmp_path), Metadata(state_dict_metadata={}), [[]], None)
    process = SaveDirectories.of_process()
    assert process.stuck == f"writing .metadata of {tmp_path}"
    hung_mount.set()  # the step returns: the rule does not depend on it
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(CheckpointInProgressError, match="writing .metadata of .* did not return in time.*restart the job"):
        process.claim(str(other))
    assert process.directories() == []
    manager = mgr.CheckpointManager(mgr.CheckpointManagerConfig(save_dir=str(tmp_path / "run")))
    with pytest.raises(AsyncSaveFailedError, match="restart the job"):
        manager.prepare_save(1)
    with pytest.raises(AsyncSaveFailedError, match="restart the job"):
        manager.commit(1)  # a commit already under way writes no tracker either


def test_a_tracker_write_left_behind_stops_the_next_commit(tmp_path, monkeypatch, hung_mount):
    """A late tracker write must never name an older checkpoint than a later commit did."""
    from megatron_async import manager as mgr

    directories = SaveDirectories()
    monkeypatch.setattr(save_directories, "coordinator_step_timeout_s", lambda: 0.3)
    manager = mgr.CheckpointManager(mgr.CheckpointManagerConfig(save_dir=str(tmp_path)), directories)
    for iteration in (1, 2):
        path = manager.prepare_save(iteration)
        for marker in COMPLETION_MARKERS:
            (tmp_path / os.path.basename(path) / marker).write_text("{}")
    calls = []

    def hung(save_dir, iteration):
        calls.append(iteration)
        hung_mount.wait()

    monkeypatch.setattr(checkpoint_dirs, "write_tracker", hung)
    with pytest.raises(AsyncSaveFailedError, match="did not return"):
        manager.commit(1)
    with pytest.raises(AsyncSaveFailedError, match="marking .*iter_0000001 as the latest checkpoint did not return in time.*restart the job"):
        manager.commit(2)
    assert calls == [1]  # refused without touching the mount
    assert SaveDirectories.of_process().stuck is None  # its own record, passed explicitly


def test_the_manifest_step_may_take_most_of_the_coordination_timeout(tmp_path, monkeypatch, hung_mount):
    """megatron-core's manifest hashes every file: it gets 0.9 of the coordination timeout
    (keeping 10 s of margin, never less than the half the other steps get), still bounded,
    and its message names the hashing."""
    from megatron_async.mcore import save_call as finalize

    for timeout_s, bound_s in ((600.0, 540.0), (60.0, 50.0), (12.0, 6.0)):
        monkeypatch.setattr(coordination, "_cached_timeout_s", timeout_s)
        assert finalize.manifest_step_timeout_s() == bound_s
    monkeypatch.setattr(coordination, "_cached_timeout_s", 1.0)
    written = []
    finalize.write_integrity_manifest(str(tmp_path), written.append)
    assert written == [str(tmp_path)]
    with pytest.raises(AsyncSaveFailedError, match="manifest .* did not return within 0.5s: it reads and hashes every file"):
        finalize.write_integrity_manifest(str(tmp_path), lambda d: hung_mount.wait())
