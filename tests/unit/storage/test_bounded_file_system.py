"""BoundedFileSystem: DCP's planning requests (mkdir, exists) to an object store or a local mount are bounded."""

import pickle
import threading
import time

import pytest

from megatron_async.storage.bounded_calls import BoundedFileSystem, ObjectStoreTimeoutError

_QUICK_S = 0.1


class _Store:
    """A file system whose answers come when ``answer`` is set (never, unless a test sets it)."""

    def __init__(self):
        self.answer, self.calls, self.other = threading.Event(), [], "passed through"

    def mkdir(self, path, exist_ok=True):
        self.calls.append(("mkdir", path, exist_ok))
        self.answer.wait(30)

    def exists(self, path):
        self.calls.append(("exists", path))
        self.answer.wait(30)
        return True


def test_a_store_that_stops_answering_fails_planning_within_the_bound():
    store = _Store()
    fs = BoundedFileSystem(store, _QUICK_S)
    for request, args in (("mkdir", ("bucket/ckpt",)), ("exists", ("bucket/ckpt/.metadata",))):
        started = time.monotonic()
        with pytest.raises(ObjectStoreTimeoutError, match="bucket/ckpt"):
            getattr(fs, request)(*args)
        assert time.monotonic() - started < 5.0  # a deadline of 0.1 s, not 30 s
    assert [call[0] for call in store.calls] == ["mkdir", "exists"]
    store.answer.set()


def test_answers_and_other_attributes_come_through_unchanged():
    store = _Store()
    store.answer.set()
    fs = BoundedFileSystem(store, _QUICK_S)
    assert fs.exists("bucket/ckpt/.metadata") is True
    fs.mkdir("bucket/ckpt", exist_ok=False)
    assert store.calls == [("exists", "bucket/ckpt/.metadata"), ("mkdir", "bucket/ckpt", False)]
    assert fs.other == "passed through"


def test_it_pickles():
    copy = pickle.loads(pickle.dumps(BoundedFileSystem(_PicklableStore(), _QUICK_S)))
    assert copy.exists("x") == "x"


class _PicklableStore:
    def exists(self, path):
        return path


def test_a_local_mount_that_hangs_fails_a_writers_planning_within_the_save_step_bound(tmp_path, monkeypatch):
    """DCP's prepare_local_plan calls mkdir and exists on every rank; on a hung local mount
    they raise FileSystemStepTimeoutError within half the coordination timeout, once."""
    from torch.distributed.checkpoint.planner import SavePlan

    from megatron_async.core import save_directories
    from megatron_async.core.save_directories import FileSystemStepTimeoutError
    from megatron_async.writer.filesystem import FileSystemWriterAsync

    monkeypatch.setattr(save_directories, "coordinator_step_timeout_s", lambda: 0.2)
    writer = FileSystemWriterAsync(str(tmp_path / "ckpt"))
    assert isinstance(writer.fs, BoundedFileSystem) and writer.fs._timeout_s is None  # the save-step bound
    assert writer.prepare_local_plan(SavePlan([])) is not None and (tmp_path / "ckpt").is_dir()
    store = _Store()
    writer.fs = BoundedFileSystem(store)
    started = time.monotonic()
    with pytest.raises(FileSystemStepTimeoutError, match="creating the folder .*ckpt did not return within 0.2s"):
        writer.prepare_local_plan(SavePlan([]))
    assert time.monotonic() - started < 5.0 and len(store.calls) == 1  # no retry
    store.answer.set()
    assert pickle.loads(pickle.dumps(BoundedFileSystem(_PicklableStore()))).exists("x") == "x"
