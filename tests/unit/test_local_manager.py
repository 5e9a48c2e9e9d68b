"""megatron_async.local.manager in one process: save, retention, failures and recovery of
a rank's own parts (replication and moves between ranks: the functional
test_local_checkpoints.py)."""

import logging
import os
import shutil
import time
import zipfile

import pytest
import torch

from megatron_async.core import AsyncCallsQueue
from megatron_async.errors import (
    AsyncSaveFailedError,
    CheckpointingException,
    LocalCheckpointError,
    StagingHandOverError,
)
from megatron_async.local import parts
from megatron_async.local.manager import LocalCheckpointManager
from megatron_async.local.parts import part_name, record_name
from megatron_async.local.state_dict import BasicTensorAwareStateDict


def _state(value: float):
    return {"w": torch.full((64,), value), "nested": [torch.arange(5), {"step": int(value)}]}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _files(manager):
    return sorted(os.listdir(manager.local_ckpt_dir))


def test_sync_save_then_find_latest_and_load_twice(tmp_path):
    saver = LocalCheckpointManager(tmp_path)
    state = _state(1.0)
    tasd = BasicTensorAwareStateDict(state)
    assert saver.save(tasd, 7) is None
    assert not tasd.is_hollow and state["w"][0] == 1.0  # the caller's state dict is left whole
    assert saver.local_ckpt_dir == tmp_path / "0"
    assert _files(saver) == [record_name(7, 0), part_name(7, 0)]
    # The part's xxh3 covers every byte: its zip records skip torch.save's CRC-32 pass.
    with zipfile.ZipFile(saver.local_ckpt_dir / part_name(7, 0)) as archive:
        assert {info.CRC for info in archive.infolist()} == {0}

    loader = LocalCheckpointManager(tmp_path)
    assert loader.find_latest() == 7
    assert loader.find_latest() == 7
    first, ckpt_id = loader.load()
    second, _ = loader.load()
    assert ckpt_id == (7, 0, "")
    assert _equal(first.state_dict, _state(1.0)) and _equal(second.state_dict, _state(1.0))
    first.state_dict["w"].add_(1)  # each load is its own copy
    assert _equal(loader.load()[0].state_dict, _state(1.0))


def test_a_restarted_job_is_told_which_copy_each_rank_loaded(tmp_path, caplog):
    # An operator reading the restart's log (and a program reading recovered_from) sees
    # that rank 0 loaded its own part of iteration 3, not a peer's replica.
    LocalCheckpointManager(tmp_path).save(BasicTensorAwareStateDict(_state(3.0)), 3)
    loader = LocalCheckpointManager(tmp_path)
    assert loader.recovered_from is None
    with caplog.at_level(logging.INFO, logger="megatron_async.local.manager"):
        assert loader.find_latest() == 3
    lines = [r for r in caplog.records if "recovered from" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in lines] == [
        (logging.INFO, "rank 0: local checkpoint 3 recovered from its own part")
    ]
    assert loader.recovered_from == 0
    loader.save(BasicTensorAwareStateDict(_state(4.0)), 4)
    assert loader.recovered_from is None  # a save starts: the recovery is history


def test_a_fresh_job_without_local_checkpoints_is_told_so_at_info(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        assert LocalCheckpointManager(tmp_path).find_latest() == -1
    assert "no local checkpoint on any rank (a fresh job)" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_async_save_snapshots_at_save_and_the_next_save_removes_older_iterations(tmp_path):
    # Unlinking the older iterations is the next save's writer's work, not the training
    # thread's finalize step: after a save the directory keeps the previous iteration too.
    manager = LocalCheckpointManager(tmp_path, session_id="s")
    queue = AsyncCallsQueue()
    try:
        state = _state(1.0)
        for iteration in (1, 2, 3):
            request = manager.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
            state["w"].add_(1)  # after save returns: not in the checkpoint
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            if iteration == 2:
                assert _files(manager) == [record_name(1, 0), part_name(1, 0),
                                           record_name(2, 0), part_name(2, 0)]
        assert manager.local_ckpt_dir == tmp_path / "s" / "0"
        assert _files(manager) == [record_name(2, 0), part_name(2, 0),
                                   record_name(3, 0), part_name(3, 0)]
    finally:
        queue.close()
    loader = LocalCheckpointManager(tmp_path, session_id="s")
    assert loader.find_latest() == 3
    expected = _state(3.0)  # the tensor added to twice before the third save; the int never
    expected["nested"][1]["step"] = 1
    assert _equal(loader.load()[0].state_dict, expected)


def test_a_save_in_flight_is_not_removed_by_the_next_save(tmp_path):
    manager = LocalCheckpointManager(tmp_path)
    queue = AsyncCallsQueue()
    try:
        first = manager.save(BasicTensorAwareStateDict(_state(1.0)), 1, is_async=True)
        queue.schedule_async_request(first)
        second = manager.save(BasicTensorAwareStateDict(_state(2.0)), 2, is_async=True)
        with pytest.raises(LocalCheckpointError, match="above the last one"):
            manager.save(BasicTensorAwareStateDict(_state(2.0)), 2, is_async=True)
        queue.maybe_finalize_async_calls(blocking=True)  # the first save only
        assert _files(manager) == [record_name(1, 0), part_name(1, 0)]
        queue.schedule_async_request(second)
        queue.maybe_finalize_async_calls(blocking=True)
        assert _files(manager) == [record_name(1, 0), part_name(1, 0),
                                   record_name(2, 0), part_name(2, 0)]
        third = manager.save(BasicTensorAwareStateDict(_state(3.0)), 3, is_async=True)
        queue.schedule_async_request(third)
        queue.maybe_finalize_async_calls(blocking=True)
        assert _files(manager) == [record_name(2, 0), part_name(2, 0),
                                   record_name(3, 0), part_name(3, 0)]
    finally:
        queue.close()


@pytest.mark.parametrize("is_async", [False, True])
def test_a_state_above_the_staging_budget_is_staged_in_rounds(tmp_path, is_async):
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(6)}  # 4 KiB each
    manager = LocalCheckpointManager(tmp_path, staging_memory_limit=9000)
    queue = AsyncCallsQueue(persistent=True)
    try:
        request = manager.save(BasicTensorAwareStateDict(state), 1, is_async=is_async)
        if is_async:
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    assert manager.staging_stats["rounds"] > 1 and manager.staging_stats["peak_bytes"] <= 9000
    loader = LocalCheckpointManager(tmp_path)
    assert loader.find_latest() == 1
    assert _equal(loader.load()[0].state_dict, state)


def test_a_failed_save_keeps_the_previous_iteration(tmp_path):
    manager = LocalCheckpointManager(tmp_path)
    manager.save(BasicTensorAwareStateDict(_state(1.0)), 1)
    # A directory where the part's dirty file goes: the writer cannot open it.
    os.makedirs(manager.local_ckpt_dir / part_name(2, 0, dirty=True))
    with pytest.raises(CheckpointingException) as caught:  # nvidia-resiliency-ext's name
        manager.save(BasicTensorAwareStateDict(_state(2.0)), 2)
    assert isinstance(caught.value, AsyncSaveFailedError)
    assert part_name(1, 0) in _files(manager)
    loader = LocalCheckpointManager(tmp_path)
    assert loader.find_latest() == 1
    assert _equal(loader.load()[0].state_dict, _state(1.0))
    os.rmdir(manager.local_ckpt_dir / part_name(2, 0, dirty=True))
    manager.save(BasicTensorAwareStateDict(_state(3.0)), 3)  # the failed 2 is gone, 1 stays
    assert _files(manager) == [record_name(1, 0), part_name(1, 0),
                               record_name(3, 0), part_name(3, 0)]


def test_a_damaged_part_is_never_loaded_and_an_older_one_is(tmp_path, caplog):
    manager = LocalCheckpointManager(tmp_path)
    manager.save(BasicTensorAwareStateDict(_state(1.0)), 1)
    kept = tmp_path / "kept"
    shutil.copytree(manager.local_ckpt_dir, kept)
    manager.save(BasicTensorAwareStateDict(_state(2.0)), 2)
    for name in os.listdir(kept):  # iteration 1 again beside 2, as after an unfinished finalize
        shutil.copy(kept / name, manager.local_ckpt_dir / name)
    path = manager.local_ckpt_dir / part_name(2, 0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    loader = LocalCheckpointManager(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert loader.find_latest() == 1
    assert "damaged" in caplog.text
    assert loader.recovered_from == 0
    assert _equal(loader.load()[0].state_dict, _state(1.0))


def test_parts_of_another_run_are_ignored(tmp_path, caplog):
    LocalCheckpointManager(tmp_path, run_id="a").save(BasicTensorAwareStateDict(_state(1.0)), 1)
    other = LocalCheckpointManager(tmp_path, run_id="b")
    with caplog.at_level(logging.WARNING):
        assert other.find_latest() == -1
    assert "run_id: 'b' != 'a'" in caplog.text
    assert "parts exist, but no iteration is recoverable" in caplog.text  # not a fresh job
    with pytest.raises(CheckpointingException, match="find_latest"):
        other.load()


def test_iterations_must_grow(tmp_path):
    manager = LocalCheckpointManager(tmp_path)
    manager.save(BasicTensorAwareStateDict(_state(1.0)), 5)
    for iteration in (5, 4, -1):
        with pytest.raises(LocalCheckpointError, match="above the last one"):
            manager.save(BasicTensorAwareStateDict(_state(1.0)), iteration)


def test_run_id_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_ASYNC_RUN_ID", "job-42")
    manager = LocalCheckpointManager(tmp_path)
    identity = manager.identity()
    assert identity.run_id == "job-42" and identity.world_size == 1
    assert (identity.replication_jump, identity.replication_factor) == (None, 1)


def test_a_failed_async_save_raises_nvidia_resiliency_exts_error(tmp_path):
    manager = LocalCheckpointManager(tmp_path)
    manager.save(BasicTensorAwareStateDict(_state(1.0)), 1)
    os.makedirs(manager.local_ckpt_dir / part_name(2, 0, dirty=True))
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(_state(2.0)), 2, is_async=True)
        )
        with pytest.raises(CheckpointingException) as caught:
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    assert isinstance(caught.value, AsyncSaveFailedError)
    assert "StorageWriteError" in str(caught.value)
    assert _files(manager) == [record_name(1, 0), part_name(1, 0), part_name(2, 0, dirty=True)]


def test_a_state_staged_in_rounds_is_refused_under_another_librarys_queue(tmp_path):
    """nvidia-resiliency-ext's queue calls preload_fn itself: nobody would hand the later
    rounds over, so the request says so at once (as our other staged requests do)."""
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(6)}
    manager = LocalCheckpointManager(tmp_path, staging_memory_limit=9000)
    request = manager.save(BasicTensorAwareStateDict(state), 1, is_async=True)
    with pytest.raises(StagingHandOverError, match="staging_memory_limit"):
        request.preload_fn()
    request.abandon()
    fits = LocalCheckpointManager(tmp_path / "fits")
    staged = fits.save(BasicTensorAwareStateDict(state), 1, is_async=True).preload_fn()
    assert not staged.gate.in_rounds
    staged.release()


def _counting_verifications(monkeypatch):
    calls = []
    verify_part = parts.verify_part

    def counted(directory, record):
        calls.append(record.key)
        return verify_part(directory, record)

    monkeypatch.setattr(parts, "verify_part", counted)
    return calls


def _flip_a_byte(path, keep_mtime=False):
    before = os.stat(path)
    time.sleep(0.02)  # past the file system's clock tick: the change gets a later ctime
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_load_maps_the_part_find_latest_verified_without_hashing_it_again(tmp_path, monkeypatch):
    # Megatron-LM's two loads after one find_latest read the part once: find_latest
    # hashes it, each load maps the same (page-cached) file while it is unchanged.
    LocalCheckpointManager(tmp_path).save(BasicTensorAwareStateDict(_state(1.0)), 1)
    calls = _counting_verifications(monkeypatch)
    loader = LocalCheckpointManager(tmp_path)
    assert loader.find_latest() == 1
    recovered = loader._recovered
    assert recovered.record.key == (1, 0)
    assert recovered.version == parts.file_version(loader.local_ckpt_dir / part_name(1, 0))
    for _ in range(2):
        assert _equal(loader.load()[0].state_dict, _state(1.0))
    assert calls == [(1, 0)]


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["written", "mtime_restored"])
def test_a_part_changed_between_find_latest_and_load_is_never_loaded(tmp_path, keep_mtime):
    # A changed file is hashed again before anything of it is loaded, even when its
    # modification time was set back (its status-change time still moved).
    LocalCheckpointManager(tmp_path).save(BasicTensorAwareStateDict(_state(1.0)), 1)
    loader = LocalCheckpointManager(tmp_path)
    assert loader.find_latest() == 1
    _flip_a_byte(loader.local_ckpt_dir / part_name(1, 0), keep_mtime)
    with pytest.raises(CheckpointingException, match="changed or vanished after find_latest"):
        loader.load()


def test_a_part_rewritten_with_the_same_bytes_is_hashed_again_and_loads(tmp_path, monkeypatch):
    LocalCheckpointManager(tmp_path).save(BasicTensorAwareStateDict(_state(1.0)), 1)
    calls = _counting_verifications(monkeypatch)
    loader = LocalCheckpointManager(tmp_path)
    assert loader.find_latest() == 1
    path = loader.local_ckpt_dir / part_name(1, 0)
    copy = tmp_path / "copy.pt"
    shutil.copy(path, copy)
    os.replace(copy, path)  # another inode, the same bytes
    assert _equal(loader.load()[0].state_dict, _state(1.0))
    assert calls == [(1, 0), (1, 0)]
    assert _equal(loader.load()[0].state_dict, _state(1.0))  # the new version is kept
    assert calls == [(1, 0), (1, 0)]


def test_a_part_changed_while_it_is_loaded_is_refused(tmp_path, monkeypatch):
    LocalCheckpointManager(tmp_path).save(BasicTensorAwareStateDict(_state(1.0)), 1)
    loader = LocalCheckpointManager(tmp_path)
    assert loader.find_latest() == 1
    path = loader.local_ckpt_dir / part_name(1, 0)
    load = torch.load

    def load_then_change(*args, **kwargs):
        state = load(*args, **kwargs)
        _flip_a_byte(path)
        return state

    monkeypatch.setattr(torch, "load", load_then_change)
    with pytest.raises(CheckpointingException, match="changed while it was loaded"):
        loader.load()


def test_an_error_while_verifying_counts_as_not_intact(tmp_path, monkeypatch, caplog):
    LocalCheckpointManager(tmp_path).save(BasicTensorAwareStateDict(_state(1.0)), 1)

    def out_of_memory(directory, record):
        raise MemoryError("no room for the part")

    monkeypatch.setattr(parts, "verify_part", out_of_memory)
    with caplog.at_level(logging.WARNING):
        assert LocalCheckpointManager(tmp_path).find_latest() == -1
    assert "cannot verify rank 0's local checkpoint part of iteration 1" in caplog.text
    assert "MemoryError: no room for the part" in caplog.text


def test_the_info_line_of_a_finalized_local_save_names_its_part_bytes_and_staging(
    tmp_path, caplog
):
    """An operator reading the queue's INFO line sees which part a local save wrote, how
    many bytes, and the staging it held (the line's fields, not shifted by one)."""
    manager = LocalCheckpointManager(tmp_path)
    queue = AsyncCallsQueue()
    try:
        with caplog.at_level(logging.INFO, logger="megatron_async.core.queue"):
            queue.schedule_async_request(
                manager.save(BasicTensorAwareStateDict(_state(1.0)), 3, is_async=True)
            )
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    part = manager.local_ckpt_dir / part_name(3, 0)
    peak, rounds = manager.staging_stats["peak_bytes"], manager.staging_stats["rounds"]
    line = next(r.getMessage() for r in caplog.records if "finalized" in r.getMessage())
    assert f"({part}):" in line, line
    assert f"{part.stat().st_size} bytes" in line, line
    assert f"staging peak {peak} bytes in {rounds} round(s)" in line, line


def test_find_latest_refuses_while_a_save_is_in_flight(tmp_path):
    # A script that looks for a checkpoint to resume from while its own save is still
    # being written could pick what that save's writer is about to remove.
    manager = LocalCheckpointManager(tmp_path)
    queue = AsyncCallsQueue()
    try:
        manager.save(BasicTensorAwareStateDict(_state(1.0)), 1)
        request = manager.save(BasicTensorAwareStateDict(_state(2.0)), 2, is_async=True)
        with pytest.raises(CheckpointingException, match=r"iteration\(s\) \[2\] are still in flight"):
            manager.find_latest()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        assert manager.find_latest() == 2
    finally:
        queue.close()
