"""Staging a ``torch.save`` file within the budget in one process: the records match
``torch.save``'s bytes in one go and in rounds, the ledger's wait is shared with torch_dist
saves, a race before a round's copy fails the write, and the refusals say what to do."""

import io
import os
import pickle
import threading

import pytest
import torch

from megatron_async.core.shared_memory import find_segment
from megatron_async.errors import (
    AsyncSaveFailedError,
    CheckpointValidationError,
    StagingMemoryError,
    StagingRaceError,
)
from megatron_async.staging.budget import StagingBufferCache, StagingLedger
from megatron_async.staging.gate import StagingGate
from megatron_async.staging.stager import BucketStager
from megatron_async.staging import torch_save
from megatron_async.staging.torch_save import stage_torch_save
from megatron_async.torch_ckpt import TorchAsyncCheckpoint
from megatron_async.writer.torch_save_file import write_torch_save_file, write_torch_save_records
from tests.unit.staging.test_overlapped_staging import _buckets

KIB = 1024


def _state():
    base = torch.arange(4 * KIB, dtype=torch.float32)
    return {
        "model": {"big": torch.randn(16 * KIB), "base": base, "view": base[100:200]},
        "list": [torch.ones(3, dtype=torch.int64), torch.tensor([True, False]), torch.empty(0)],
        "half": torch.arange(6.0).bfloat16(),
        "storage": torch.arange(5, dtype=torch.int16).untyped_storage(),
        "step": 7,
        "name": "run",
    }


def _stage(obj, limit, timeout_s=30.0, protocol=2, byteorder=True, stats=None):
    return stage_torch_save(obj, pickle, protocol, byteorder, limit, timeout_s,
                            {} if stats is None else stats)


def _write(staged):
    """Write as the caller runs a request: the later rounds copy beside the writer."""
    stream = io.BytesIO()
    staged.hand_over(os.getpid(), finish=False)
    try:
        write_torch_save_records(stream, staged, 30.0)
    finally:
        staged.gate.mark_done()
        staged.finish_staging()
        staged.release()
    return stream.getvalue()


def _torch_save_bytes(obj, **kwargs):
    stream = io.BytesIO()
    torch.save(obj, stream, **kwargs)
    return stream.getvalue()


def _assert_equal(loaded, expected):
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        elif isinstance(value, dict):
            _assert_equal(loaded[key], value)
        elif isinstance(value, list):
            assert all(torch.equal(a, b) for a, b in zip(loaded[key], value)), key
        elif isinstance(value, torch.UntypedStorage):
            assert bytes(loaded[key]) == bytes(value)
        else:
            assert loaded[key] == value, key


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit", [None, 72 * KIB, 64 * KIB])
def test_the_file_is_byte_identical_to_torch_save_in_one_go_and_in_rounds(limit):
    state, stats = _state(), {}
    data = _write(_stage(state, limit, stats=stats))
    assert data == _torch_save_bytes(state)
    assert (stats["rounds"] > 1) == (limit is not None), stats
    if limit is not None:
        assert stats["peak_bytes"] <= limit
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    _assert_equal(loaded, state)
    # Storage sharing survives, as with torch.save: the view is saved with its base.
    assert loaded["model"]["view"].untyped_storage().data_ptr() == loaded["model"]["base"].untyped_storage().data_ptr()


def test_pickle_options_match_torch_save():
    state = _state()
    data = _write(_stage(state, None, protocol=4, byteorder=False))
    assert data == _torch_save_bytes(state, pickle_protocol=4, _disable_byteorder_record=True)


def test_async_save_takes_torch_saves_arguments(tmp_path):
    state, path = _state(), str(tmp_path / "x.pt")
    ckpt = TorchAsyncCheckpoint()
    try:
        ckpt.async_save(state, path, pickle, 4, _disable_byteorder_record=True)  # as torch.save
        ckpt.finalize_async_save(blocking=True)
    finally:
        ckpt.close()
    assert open(path, "rb").read() == _torch_save_bytes(state, pickle_protocol=4, _disable_byteorder_record=True)


def test_a_second_save_to_a_path_in_flight_is_refused_until_finalized(tmp_path):
    from megatron_async.errors import CheckpointInProgressError

    path = str(tmp_path / "x.pt")
    ckpt = TorchAsyncCheckpoint()
    try:
        ckpt.async_save({"w": torch.zeros(2)}, path)
        with pytest.raises(CheckpointInProgressError, match="not finalized.*finalize_async_save\\(blocking=True\\)"):
            ckpt.async_save({"w": torch.ones(2)}, path)
        ckpt.finalize_async_save(blocking=True)
        ckpt.async_save({"w": torch.ones(2)}, path)
        ckpt.finalize_async_save(blocking=True)
    finally:
        ckpt.close()
    assert torch.equal(torch.load(path)["w"], torch.ones(2))


def test_an_unclosed_checkpoint_object_dropped_with_a_save_frees_its_path(tmp_path):
    """The path's claim is the process's: an object dropped without close() (its queue
    aborts the save) must not leave the path refused for the rest of the process."""
    import gc

    path = str(tmp_path / "x.pt")
    ckpt = TorchAsyncCheckpoint()
    ckpt.async_save({"w": torch.zeros(2)}, path)
    del ckpt
    gc.collect()
    ckpt = TorchAsyncCheckpoint()
    try:
        ckpt.async_save({"w": torch.ones(2)}, path)
        ckpt.finalize_async_save(blocking=True)
    finally:
        ckpt.close()
    assert torch.equal(torch.load(path)["w"], torch.ones(2))


def test_a_failed_save_frees_its_path_and_a_step_left_behind_refuses_later_saves(tmp_path):
    """The file's claim is the process's record of what it writes: a failed save frees the
    path at once; a file-system step left behind on a hung mount refuses every later save
    of the process, torch.save files too, saying to restart the job."""
    import threading

    from megatron_async.core.save_directories import FileSystemStepTimeoutError, SaveDirectories
    from megatron_async.errors import CheckpointInProgressError

    path = str(tmp_path / "x.pt")
    ckpt = TorchAsyncCheckpoint(staging_memory_limit=1)  # too small: the save fails
    try:
        ckpt.async_save({"w": torch.zeros(1024)}, path)
        with pytest.raises(AsyncSaveFailedError):
            ckpt.finalize_async_save(blocking=True)
        ckpt.staging_memory_limit = None
        ckpt.async_save({"w": torch.ones(2)}, path)
        ckpt.finalize_async_save(blocking=True)
        recovered = threading.Event()
        with pytest.raises(FileSystemStepTimeoutError):
            SaveDirectories.of_process().run_bounded("writing .metadata (test)", recovered.wait, timeout_s=0.1)
        recovered.set()
        with pytest.raises(CheckpointInProgressError, match="did not return.*restart the job"):
            ckpt.async_save({"w": torch.zeros(2)}, str(tmp_path / "y.pt"))
    finally:
        ckpt.close()
    assert torch.equal(torch.load(path)["w"], torch.ones(2)) and not os.path.exists(tmp_path / "y.pt")


def test_non_tensor_leaves_are_frozen_when_scheduling_returns():
    state = {"w": torch.ones(4), "meta": {"step": 1}}
    staged = _stage(state, None)
    state["meta"]["step"] = 2  # the trainer moves on before the writer runs
    state["w"].add_(1)
    loaded = torch.load(io.BytesIO(_write(staged)), weights_only=True)
    assert loaded["meta"] == {"step": 1} and torch.equal(loaded["w"], torch.ones(4))


@pytest.mark.timeout(60)
def test_a_tensor_changed_before_its_round_is_copied_fails_the_write():
    tensors = {f"t{i}": torch.full((KIB,), float(i)) for i in range(4)}  # 4 KiB each
    stats = {}
    staged = _stage(tensors, 8 * KIB, stats=stats)
    assert stats["rounds"] == 2
    tensors["t3"].add_(1)  # before its round: the writer has not freed the pool yet
    with pytest.raises(StagingRaceError, match="'t3' was modified in place"):
        _write(staged)


def test_a_tensor_larger_than_the_budget_is_refused_naming_it_and_the_budget_it_needs():
    held = StagingLedger.of_process().held_bytes()
    with pytest.raises(StagingMemoryError, match=r"'model.big' alone needs 65536 bytes.*at least 65536"):
        _stage(_state(), 32 * KIB)
    assert StagingLedger.of_process().held_bytes() == held


@pytest.mark.timeout(60)
def test_a_save_waits_for_the_budget_an_earlier_save_holds_even_a_torch_dist_one():
    state = {"w": torch.zeros(4 * KIB)}  # 16 KiB
    ledger = StagingLedger.of_process()
    earlier = StagingGate(1)  # any save of this process being written, torch_dist ones included
    BucketStager(earlier, _buckets([torch.zeros(4 * KIB)]), timeout_s=1.0).stage()
    with pytest.raises(StagingMemoryError, match="still holds 16384 of the 16384-byte"):
        _stage(state, None, timeout_s=0.2)  # default budget: one copy of the state
    threading.Timer(0.2, earlier.mark_done).start()
    staged = _stage(state, None, timeout_s=30.0)  # returns once the earlier writer is done
    assert ledger.held_bytes() == 16 * KIB
    assert torch.load(io.BytesIO(_write(staged)))["w"].equal(state["w"])
    assert ledger.held_bytes() == 0


_FAILED_WRITE_SCRIPT = """
import sys, torch
from megatron_async.staging.gate import StagingGate
from megatron_async.staging.stager import BucketStager
from tests.unit.staging.test_torch_save_staging import _stage, KIB
from megatron_async.writer.torch_save_file import write_torch_save_file
staged = _stage({f"t{i}": torch.full((KIB,), float(i)) for i in range(4)}, 8 * KIB)
staged.gate.fail("a tensor changed before its copy")  # the write fails after its header
try:
    write_torch_save_file(sys.argv[1], staged, 5.0)
except Exception as exc:
    print("raised", type(exc).__name__)
import gc; del staged; gc.collect()
print("alive")
"""


@pytest.mark.timeout(120)
def test_a_write_that_fails_into_a_real_file_does_not_abort_the_writer(tmp_path):
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    target = tmp_path / "x.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _FAILED_WRITE_SCRIPT, str(target)], cwd=repo,
        env=dict(os.environ, PYTHONPATH=repo), capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]  # was -6: std::terminate in the destructor
    assert "raised StagingRaceError" in proc.stdout and "alive" in proc.stdout, proc.stdout
    assert not target.exists() and os.listdir(tmp_path) == []


def test_a_failed_write_gives_the_staging_memory_back(tmp_path):
    staged = _stage({"w": torch.ones(8)}, None)
    with pytest.raises(OSError):
        write_torch_save_file(str(tmp_path / "missing" / "x.pt"), staged, 5.0)
    assert staged.gate.writer_done
    assert not (tmp_path / "missing").exists()


def test_staged_data_kept_until_finalize_gives_its_segment_back_once_its_writer_is_done():
    # The caller keeps the staged data until finalize: the loan that ends at the writer's
    # done mark drops the save's own segment too, so memory held follows the ledger.
    staged = _stage({"w": torch.ones(KIB)}, None)
    assert staged.buffer is not None and not staged.loan.over()  # held while the writer reads
    staged.gate.mark_done()
    assert staged.loan.over() and staged.buffer is None


@pytest.mark.timeout(120)
def test_async_save_in_rounds_saves_the_state_at_scheduling(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="megatron_async.core.queue")
    ckpt = TorchAsyncCheckpoint(staging_memory_limit=64 * KIB)
    try:
        state = {f"t{i}": torch.full((8 * KIB,), float(i)) for i in range(8)}  # 256 KiB
        expected = {k: v.clone() for k, v in state.items()}
        path = str(tmp_path / "model.pt")
        ckpt.async_save(state, path)
        assert ckpt.staging_stats["rounds"] >= 4
        for tensor in state.values():
            tensor.add_(100.0)  # the next step, right after async_save returned
        ckpt.finalize_async_save(blocking=True)
        loaded = torch.load(path, weights_only=True)
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[k], v) for k, v in expected.items())
        assert os.listdir(tmp_path) == ["model.pt"]
        (line,) = [r.getMessage() for r in caplog.records if "finalized (" in r.getMessage()]
        assert f"staging peak {64 * KIB} bytes in {ckpt.staging_stats['rounds']} round(s)" in line
    finally:
        ckpt.close()


@pytest.mark.timeout(60)
def test_a_refused_async_save_fails_at_finalize_and_leaves_no_file(tmp_path):
    ckpt = TorchAsyncCheckpoint(staging_memory_limit=KIB)
    try:
        ckpt.async_save({"w": torch.zeros(1024)}, str(tmp_path / "x.pt"))
        with pytest.raises(AsyncSaveFailedError, match="'w' alone needs 4096 bytes"):
            ckpt.finalize_async_save(blocking=True)
        assert os.listdir(tmp_path) == []
    finally:
        ckpt.close()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"_use_new_zipfile_serialization": False}, CheckpointValidationError, "zip format only"),
    ({"map_location": "cpu"}, TypeError, "map_location"),  # as torch.save refuses it
])
def test_options_torch_save_does_not_take_are_refused(tmp_path, kwargs, error, message):
    ckpt = TorchAsyncCheckpoint()
    try:
        with pytest.raises(error, match=message):
            ckpt.async_save({"w": torch.zeros(2)}, str(tmp_path / "x.pt"), **kwargs)
        assert os.listdir(tmp_path) == []
    finally:
        ckpt.close()


def test_a_directory_as_destination_is_refused_before_anything_runs(tmp_path):
    ckpt = TorchAsyncCheckpoint()
    try:
        with pytest.raises(CheckpointValidationError, match="it is a directory; torch.save writes one file"):
            ckpt.async_save({"w": torch.zeros(2)}, tmp_path)
        assert os.listdir(tmp_path) == [] and ckpt.finalize_async_save(blocking=True) == []
    finally:
        ckpt.close()


@pytest.mark.parametrize("limit", [0, -1, 1.5, "1G", True])
def test_an_invalid_limit_is_refused(limit):
    with pytest.raises(CheckpointValidationError, match="staging_memory_limit must be"):
        TorchAsyncCheckpoint(staging_memory_limit=limit)


@pytest.mark.timeout(240)
def test_the_nvrx_surface_saves_in_rounds_through_the_persistent_worker(tmp_path):
    from megatron_async.nvrx.torch_ckpt import TorchAsyncCheckpoint as NvrxTorchAsyncCheckpoint
    from tests.persistent_worker import wait_until_worker_ready

    ckpt = NvrxTorchAsyncCheckpoint(True, staging_memory_limit=64 * KIB)  # persistent_queue
    try:
        wait_until_worker_ready(ckpt._queue)  # the staged records travel to the worker
        state = _state()
        path = str(tmp_path / "model.pt")
        ckpt.async_save(state, path)
        assert ckpt.staging_stats["rounds"] > 1
        ckpt.finalize_async_save(blocking=True)
        assert open(path, "rb").read() == _torch_save_bytes(state)
    finally:
        ckpt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("limit", [None, 64 * KIB])
def test_device_tensors_are_written_as_their_host_copy(limit):
    state = {"w": torch.randn(16 * KIB, device="cuda"), "b": torch.arange(10, device="cuda")}
    data = _write(_stage(state, limit))
    assert data == _torch_save_bytes({k: v.cpu() for k, v in state.items()})
    loaded = torch.load(io.BytesIO(data), weights_only=True)  # on the CPU, as nvrx's files
    assert all(loaded[k].device.type == "cpu" and torch.equal(loaded[k], v.cpu()) for k, v in state.items())


def test_saving_after_close_says_to_create_a_new_torch_async_checkpoint(tmp_path):
    from megatron_async.errors import QueueClosedError

    saver = TorchAsyncCheckpoint(persistent_queue=False)
    saver.close()
    with pytest.raises(QueueClosedError, match="create a new TorchAsyncCheckpoint"):
        saver.async_save({"w": torch.ones(2)}, str(tmp_path / "w.pt"))
    assert not os.path.exists(tmp_path / "w.pt")


def _segment_id(staged):
    """The registered segment the save staged into (ids are never reused, addresses are)."""
    return find_segment(staged.buffer).segment_id


def test_an_owner_that_saves_often_stages_into_the_same_segment_once_its_writer_is_done(monkeypatch):
    # Local checkpoints every few iterations: allocating a state's worth of shared memory
    # per save was half of a local save's stall. The owner's cache lends the last save's
    # segment again only once that save's writer read it; a save that overlaps gets its
    # own and leaves the first save's bytes alone; a failed staging drops its segment (a
    # device copy that timed out may still land there) and the cache lends a new one.
    cache = StagingBufferCache()
    state = {"w": torch.arange(KIB, dtype=torch.float32)}

    def stage():  # a budget of several copies: saves may overlap
        return stage_torch_save(state, pickle, 2, True, 64 * KIB, 5.0, {}, cache=cache)

    first = stage()
    first_segment = _segment_id(first)
    overlapping = stage()  # the first save's writer has not read it yet
    assert _segment_id(overlapping) != first_segment
    expected = _torch_save_bytes(state, _use_new_zipfile_serialization=True)
    assert _write(first) == expected
    assert _write(overlapping) == expected

    again = stage()
    assert _segment_id(again) == first_segment
    state["w"].add_(1)
    assert _write(again) == expected  # staged before the change, which does not reach the file
    reused = stage()
    assert _segment_id(reused) == first_segment
    assert torch.load(io.BytesIO(_write(reused)), weights_only=True)["w"][0] == 1

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        stage_torch_save({"w": state["w"], "x": Unpicklable()}, pickle, 2, True, 64 * KIB, 5.0,
                         {}, cache=cache)
    after_pickle_failure = stage()  # the pickle fails before any segment is lent
    assert _segment_id(after_pickle_failure) == first_segment
    after_pickle_failure.release()

    def copy_fails(*args):
        raise RuntimeError("a copy failed")

    monkeypatch.setattr(torch_save, "_storage_copy", copy_fails)
    with pytest.raises(RuntimeError, match="a copy failed"):
        stage()
    monkeypatch.undo()
    fresh = stage()  # the segment of a failed copy is dropped: a new one
    fresh_segment = _segment_id(fresh)
    assert fresh_segment != first_segment
    assert _write(fresh) == _torch_save_bytes(state, _use_new_zipfile_serialization=True)
    last = stage()
    assert _segment_id(last) == fresh_segment
    last.release()  # nothing left held in the process's ledger for the next tests
