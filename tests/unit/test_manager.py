"""Unit tests of megatron_async.manager: tracker atomicity, resume choice, retention.

Single process (no torch.distributed): the manager's collectives then reduce to local
calls, so these tests exercise the coordinator-rank logic directly.
"""

from __future__ import annotations

import os
import threading

import pytest

from megatron_async import checkpoint_dirs as dirs
from megatron_async import manager as mgr
from megatron_async.checkpoint_dirs import CheckpointInfo, read_tracker, select_for_deletion, write_tracker
from megatron_async.errors import AsyncSaveFailedError, CheckpointValidationError
from megatron_async.format import COMPLETION_MARKERS, TRACKER_FILE
from megatron_async.manager import CheckpointManager, CheckpointManagerConfig

pytestmark = pytest.mark.timeout(60)


def make_checkpoint(save_dir, iteration, complete=True):
    """Create an ``iter_*`` directory with a shard file and, if complete, both markers."""
    path = os.path.join(str(save_dir), dirs.checkpoint_dir_name(iteration))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(b"shard")
    if complete:
        for marker in COMPLETION_MARKERS:
            with open(os.path.join(path, marker), "w") as f:
                f.write("{}")
    return path


def iterations_on_disk(save_dir):
    return [c.iteration for c in dirs.list_checkpoints(str(save_dir))]


def test_directory_names_follow_megatron_lm():
    assert dirs.checkpoint_dir_name(100) == "iter_0000100"
    assert TRACKER_FILE == "latest_checkpointed_iteration.txt"


def test_only_directories_with_both_markers_are_complete(tmp_path):
    complete = make_checkpoint(tmp_path, 1)
    only_shards = make_checkpoint(tmp_path, 2, complete=False)
    only_json = make_checkpoint(tmp_path, 3, complete=False)
    open(os.path.join(only_json, "metadata.json"), "w").close()
    assert dirs.is_complete_checkpoint(complete)
    assert not dirs.is_complete_checkpoint(only_shards)
    assert not dirs.is_complete_checkpoint(only_json)
    assert [c.complete for c in dirs.list_checkpoints(str(tmp_path))] == [True, False, False]


def test_tracker_round_trips_and_leaves_no_temporary_file(tmp_path):
    assert read_tracker(str(tmp_path)) is None
    write_tracker(str(tmp_path), 7)
    write_tracker(str(tmp_path), 12)
    assert read_tracker(str(tmp_path)) == 12
    assert os.listdir(tmp_path) == [TRACKER_FILE]


def test_tracker_is_never_seen_partially_written(tmp_path):
    write_tracker(str(tmp_path), 0)
    seen, errors = [], []
    done = threading.Event()

    def read_continuously():
        while not done.is_set():
            try:
                seen.append(read_tracker(str(tmp_path)))
            except Exception as exc:  # a torn or empty read shows up here
                errors.append(exc)

    reader = threading.Thread(target=read_continuously)
    reader.start()
    try:
        for iteration in range(1, 300):
            write_tracker(str(tmp_path), iteration * 1000)
    finally:
        done.set()
        reader.join(timeout=10)
    assert not errors
    assert seen and all(value == 0 or value % 1000 == 0 for value in seen)


class _FailingFsync:
    """A stand-in for os.fsync that fails, like a full or broken disk."""

    def __call__(self, fd):
        raise OSError(28, "No space left on device")


def test_failed_tracker_write_keeps_the_old_tracker(tmp_path, monkeypatch):
    write_tracker(str(tmp_path), 5)
    monkeypatch.setattr(mgr.os, "fsync", _FailingFsync())
    with pytest.raises(OSError):
        write_tracker(str(tmp_path), 6)
    monkeypatch.undo()
    assert read_tracker(str(tmp_path)) == 5
    assert os.listdir(tmp_path) == [TRACKER_FILE]


@pytest.mark.parametrize("content", ["release", "", "12abc"])
def test_unreadable_tracker_raises_a_clear_error(tmp_path, content):
    (tmp_path / TRACKER_FILE).write_text(content)
    with pytest.raises(CheckpointValidationError, match="expected an iteration number"):
        read_tracker(str(tmp_path))


def resume(tmp_path, iteration=None):
    manager = CheckpointManager(CheckpointManagerConfig(load_dir=str(tmp_path)))
    return manager.find_resume_point(iteration)


def test_resume_follows_the_tracker(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4)
    write_tracker(str(tmp_path), 2)
    point = resume(tmp_path)
    assert (point.iteration, point.reason) == (2, "tracker")
    assert point.path == os.path.join(str(tmp_path), "iter_0000002")


def test_resume_never_chooses_an_incomplete_directory(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4, complete=False)
    make_checkpoint(tmp_path, 6, complete=False)
    write_tracker(str(tmp_path), 4)
    assert resume(tmp_path).iteration == 2
    (tmp_path / TRACKER_FILE).unlink()
    assert resume(tmp_path).iteration == 2
    with pytest.raises(CheckpointValidationError, match="not a complete checkpoint"):
        resume(tmp_path, iteration=6)


def test_resume_without_complete_checkpoints_starts_fresh(tmp_path):
    assert resume(tmp_path) is None
    make_checkpoint(tmp_path, 3, complete=False)
    assert resume(tmp_path) is None
    assert CheckpointManager(CheckpointManagerConfig()).find_resume_point() is None


def test_resume_from_a_requested_iteration(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4)
    write_tracker(str(tmp_path), 4)
    point = resume(tmp_path, iteration=2)
    assert (point.iteration, point.reason) == (2, "requested")


def test_commit_writes_the_tracker_only_for_a_complete_checkpoint(tmp_path):
    manager = CheckpointManager(CheckpointManagerConfig(save_dir=str(tmp_path)))
    path = manager.prepare_save(2)
    assert manager.in_flight == {2}
    make_checkpoint(tmp_path, 2)
    manager.commit(2)
    assert read_tracker(str(tmp_path)) == 2 and manager.in_flight == set()

    manager.prepare_save(4)
    make_checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(AsyncSaveFailedError, match="missing"):
        manager.commit(4)
    assert read_tracker(str(tmp_path)) == 2
    assert os.path.isdir(path)


def test_prepare_save_clears_remains_and_refuses_the_tracked_checkpoint(tmp_path):
    manager = CheckpointManager(CheckpointManagerConfig(save_dir=str(tmp_path)))
    stale = make_checkpoint(tmp_path, 4, complete=False)
    assert manager.prepare_save(4) == stale
    assert os.listdir(stale) == []
    with pytest.raises(CheckpointValidationError, match="already in flight"):
        manager.prepare_save(4)

    make_checkpoint(tmp_path, 2)
    write_tracker(str(tmp_path), 2)
    with pytest.raises(AsyncSaveFailedError, match="refusing to overwrite"):
        manager.prepare_save(2)
    assert dirs.is_complete_checkpoint(os.path.join(str(tmp_path), "iter_0000002"))


def info(iteration, complete=True):
    return CheckpointInfo(iteration, f"/ckpt/iter_{iteration:07d}", complete)


def test_retention_keeps_the_newest_complete_checkpoints():
    checkpoints = [info(i) for i in (1, 2, 3, 4, 5)]
    victims = select_for_deletion(checkpoints, keep_last_n=2, protected={5})
    assert [v.iteration for v in victims] == [1, 2, 3]


def test_retention_never_deletes_the_tracked_or_in_flight_checkpoints():
    checkpoints = [info(1), info(2), info(3), info(4, complete=False)]
    # The tracker points at 1 (say a later commit failed) and 4 is still being written.
    victims = select_for_deletion(checkpoints, keep_last_n=1, protected={1, 4})
    assert [v.iteration for v in victims] == [2]


def test_retention_removes_remains_of_failed_saves_but_not_newer_ones():
    checkpoints = [info(1, complete=False), info(2), info(3), info(4, complete=False)]
    victims = select_for_deletion(checkpoints, keep_last_n=1, protected={3})
    assert [v.iteration for v in victims] == [1, 2]


def test_commit_applies_retention_on_disk(tmp_path):
    manager = CheckpointManager(
        CheckpointManagerConfig(save_dir=str(tmp_path), keep_last_n=2)
    )
    for iteration in (2, 4):
        manager.prepare_save(iteration)
        make_checkpoint(tmp_path, iteration)
        manager.commit(iteration)
    manager.prepare_save(6)  # in flight while 8 commits
    manager.prepare_save(8)
    make_checkpoint(tmp_path, 8)
    manager.commit(8)
    assert iterations_on_disk(tmp_path) == [4, 6, 8]
    assert read_tracker(str(tmp_path)) == 8
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(save_dir="/x", keep_last_n=0), "at least 1"),
        (dict(keep_last_n=2), "needs a save_dir"),
    ],
)
def test_config_rejects_unusable_retention(kwargs, message):
    with pytest.raises(CheckpointValidationError, match=message):
        CheckpointManagerConfig(**kwargs)


def test_abandoned_save_can_be_prepared_again(tmp_path):
    manager = CheckpointManager(CheckpointManagerConfig(save_dir=str(tmp_path)))
    manager.prepare_save(3)
    assert manager.in_flight == {3}
    manager.abandon(3)  # its save failed; the job goes on
    assert manager.in_flight == set()
    manager.prepare_save(3)


@pytest.mark.parametrize("iteration", ["2", 2.0, True, -1, None])
def test_an_iteration_that_is_no_step_number_is_refused_with_a_clear_error(tmp_path, iteration):
    manager = CheckpointManager(CheckpointManagerConfig(save_dir=str(tmp_path)))
    with pytest.raises(CheckpointValidationError, match="iteration must be an int >= 0"):
        manager.prepare_save(iteration)
    assert os.listdir(tmp_path) == [] and manager.in_flight == set()


def test_attach_commit_refuses_what_is_no_async_request(tmp_path):
    from megatron_async.core.request import AsyncRequest

    manager = CheckpointManager(CheckpointManagerConfig(save_dir=str(tmp_path)))
    with pytest.raises(CheckpointValidationError, match="got NoneType: pass what dist_checkpointing.save"):
        manager.attach_commit(None, 2)
    request = AsyncRequest(None, (), [])
    with pytest.raises(CheckpointValidationError, match="iteration must be an int"):
        manager.attach_commit(request, "2")
    assert request.finalize_fns == []


def test_construction_creates_a_missing_save_dir_and_leaves_no_probe(tmp_path):
    save_dir = tmp_path / "runs" / "gpt"
    CheckpointManager(CheckpointManagerConfig(save_dir=str(save_dir)))
    assert save_dir.is_dir() and os.listdir(save_dir) == []


@pytest.mark.parametrize("where", ["under_a_file", "is_a_file"])
def test_construction_refuses_a_save_dir_that_cannot_be_written(tmp_path, where):
    # A path under a regular file stops root too (chmod would not).
    afile = tmp_path / "afile"
    afile.write_text("")
    save_dir = str(afile / "ckpt") if where == "under_a_file" else str(afile)
    with pytest.raises(CheckpointValidationError, match="is not writable") as caught:
        CheckpointManager(CheckpointManagerConfig(save_dir=save_dir))
    assert f"save directory {save_dir} is not writable" in str(caught.value)
    assert "rank 0" in str(caught.value) and "NotADirectoryError" in str(caught.value)


def test_construction_checks_nothing_without_a_save_dir(tmp_path):
    CheckpointManager(CheckpointManagerConfig(load_dir=str(tmp_path / "missing")))
    assert not (tmp_path / "missing").exists()


def test_a_save_dir_check_on_a_hung_mount_fails_within_its_bound(tmp_path, monkeypatch):
    from megatron_async import checkpoint_dirs
    from megatron_async.core import save_directories

    release = threading.Event()
    monkeypatch.setattr(checkpoint_dirs, "storage_for", lambda path: release.wait(30))
    monkeypatch.setattr(save_directories, "coordinator_step_timeout_s", lambda: 0.2)
    try:
        with pytest.raises(CheckpointValidationError, match="did not return within .*check the mount"):
            CheckpointManager(CheckpointManagerConfig(save_dir=str(tmp_path)))
    finally:
        release.set()
