"""The checks of a save's target directory, one rank, without a distributed job."""

import logging
import os
from types import SimpleNamespace

import pytest

from megatron_async.errors import CheckpointInProgressError, CheckpointValidationError
from megatron_async.format import COMPLETION_MARKERS
from megatron_async.mcore import target
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.mcore.in_flight import checkpoints_in_flight
from megatron_async.mcore.target import check_save_target


def _complete(path):
    for name in COMPLETION_MARKERS:
        (path / name).write_text("{}")
    return str(path)


def test_a_missing_target_or_a_file_is_refused(tmp_path):
    config = TorchDistSaveConfig()
    with pytest.raises(CheckpointValidationError, match="rank 0: .* does not exist; create it"):
        check_save_target(str(tmp_path / "missing"), config, True)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointValidationError, match="is not a directory"):
        check_save_target(str(tmp_path / "a-file"), config, True)


def test_a_directory_still_being_written_is_refused(tmp_path):
    token = checkpoints_in_flight.claim(str(tmp_path))
    try:
        with pytest.raises(CheckpointInProgressError, match="not finalized yet"):
            check_save_target(str(tmp_path), TorchDistSaveConfig(), False)
    finally:
        checkpoints_in_flight.release(str(tmp_path), token)
    check_save_target(str(tmp_path), TorchDistSaveConfig(), False)


def test_a_complete_checkpoint_is_refused_or_made_incomplete_on_the_coordinator(tmp_path, caplog):
    path = _complete(tmp_path)
    refusing = TorchDistSaveConfig(overwrite=False)
    check_save_target(path, refusing, False)  # only the coordinator looks
    with pytest.raises(CheckpointValidationError, match="overwrite=False; save into a new directory"):
        check_save_target(path, refusing, True)
    assert all(os.path.exists(os.path.join(path, name)) for name in COMPLETION_MARKERS)
    with caplog.at_level(logging.WARNING, logger=target.__name__):
        check_save_target(path, TorchDistSaveConfig(), True)
    assert not any(os.path.exists(os.path.join(path, name)) for name in COMPLETION_MARKERS)
    assert "overwriting the torch_dist checkpoint" in caplog.text


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
    with pytest.raises(CheckpointValidationError, match="overwrite=False; save under a new prefix"):
        check_save_target(url, SimpleNamespace(use_msc=True, overwrite=False), True)
    check_save_target(url, SimpleNamespace(use_msc=True, overwrite=True), True)
    assert store.files == set()


def test_a_link_to_a_directory_still_being_written_is_refused(tmp_path):
    target_dir, link = tmp_path / "iter_2", tmp_path / "latest"
    target_dir.mkdir()
    link.symlink_to(target_dir)
    token = checkpoints_in_flight.claim(str(target_dir))
    try:
        with pytest.raises(CheckpointInProgressError, match="not finalized yet"):
            check_save_target(str(link), TorchDistSaveConfig(), False)
    finally:
        checkpoints_in_flight.release(str(link), token)  # either name ends the claim
    assert str(target_dir) not in checkpoints_in_flight
    check_save_target(str(link), TorchDistSaveConfig(), False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["first call", "setting aside"])
def test_a_target_check_on_a_hung_mount_fails_within_its_bound_and_gives_back_what_it_took(
    tmp_path, monkeypatch, where
):
    """On a hung mount even os.path.exists never returns: the check gives up within half
    the coordination timeout; when it returns later, its claim and the markers it set
    aside are given back, and the directory stays taken until then."""
    import threading
    import time

    from megatron_async.core import coordinator_step
    from megatron_async.core.coordinator_step import FileSystemStepTimeoutError

    path = _complete(tmp_path)
    recovered = threading.Event()
    monkeypatch.setattr(coordinator_step, "coordinator_step_timeout_s", lambda: 0.3)
    name = "storage_for" if where == "first call" else "set_aside"
    real = getattr(target, name)
    monkeypatch.setattr(target, name, lambda *args, **kwargs: (recovered.wait(), real(*args, **kwargs))[1])
    started = time.monotonic()
    try:
        with pytest.raises(FileSystemStepTimeoutError, match="checking the save target .* did not return within 0.3s"):
            target.claim_save_target(path, TorchDistSaveConfig(), True)
        assert time.monotonic() - started < 5
        with pytest.raises(CheckpointInProgressError, match="checking the save target .* is still running"):
            target.claim_save_target(path, TorchDistSaveConfig(), True)
    finally:
        recovered.set()
    deadline = time.monotonic() + 10
    while coordinator_step.steps_left_behind(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not coordinator_step.steps_left_behind(path)
    assert sorted(os.listdir(tmp_path)) == sorted(COMPLETION_MARKERS)  # set aside late, put back
    assert path not in checkpoints_in_flight
    monkeypatch.setattr(target, name, real)
    token, aside = target.claim_save_target(path, TorchDistSaveConfig(), True)  # free again
    assert aside.moved and path in checkpoints_in_flight
    checkpoints_in_flight.release(path, token)
    aside.restore()


def _wait_until_free(path):
    import time

    from megatron_async.core import coordinator_step

    deadline = time.monotonic() + 10
    while coordinator_step.steps_left_behind(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not coordinator_step.steps_left_behind(path)


def test_an_interrupt_during_the_target_check_leaves_nothing_claimed_or_set_aside(tmp_path, monkeypatch):
    import threading

    path = _complete(tmp_path)
    recovered = threading.Event()
    real_set_aside = target.set_aside
    monkeypatch.setattr(target, "set_aside", lambda *args: (recovered.wait(10), real_set_aside(*args))[1])
    started = []

    def interrupted_while_waiting(what, step, **kwargs):  # the wait for the check is interrupted
        started.append(threading.Thread(target=step, daemon=True))
        started[0].start()
        raise KeyboardInterrupt

    monkeypatch.setattr(target, "run_coordinator_step", interrupted_while_waiting)
    with pytest.raises(KeyboardInterrupt):
        target.claim_save_target(path, TorchDistSaveConfig(), True)
    recovered.set()
    started[0].join(10)
    assert path not in checkpoints_in_flight
    assert sorted(os.listdir(tmp_path)) == sorted(COMPLETION_MARKERS)  # set aside late, put back


def test_a_check_result_that_comes_as_the_wait_ends_is_put_back_before_the_directory_is_free(tmp_path):
    import threading

    from megatron_async.core import coordinator_step

    path = _complete(tmp_path)
    hand_over = target._HandOver(path)
    token, aside = hand_over.give(target.set_aside(path, COMPLETION_MARKERS))
    assert path in checkpoints_in_flight and aside.moved
    restoring, proceed = threading.Event(), threading.Event()
    real_restore = aside.restore

    def slow_restore():
        restoring.set()
        proceed.wait(10)
        real_restore()

    aside.restore = slow_restore
    hand_over.abandon()  # the wait ended just as the result came
    assert restoring.wait(10)
    assert coordinator_step.steps_left_behind(path) and path in checkpoints_in_flight  # still taken
    proceed.set()
    _wait_until_free(path)
    assert path not in checkpoints_in_flight
    assert sorted(os.listdir(tmp_path)) == sorted(COMPLETION_MARKERS)
