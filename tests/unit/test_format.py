"""The on-disk format: atomic, durable small files (local storage) and the completion markers."""

import dataclasses
import os
import pickle

import pytest

from megatron_async import format as fmt
from megatron_async.integrity import checksums
from megatron_async.storage import local
from megatron_async.storage.local import LocalStorage

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fsynced(monkeypatch):
    """Record every path handed to ``storage.local.fsync_path`` (the directory fsyncs)."""
    seen = []
    real = local.fsync_path

    def record(path, best_effort=False):
        seen.append(os.path.abspath(os.fspath(path)))
        real(path, best_effort)

    monkeypatch.setattr(local, "fsync_path", record)
    return seen


def test_write_atomically_replaces_the_file_and_fsyncs_its_directory(tmp_path, fsynced):
    target = tmp_path / "file.txt"
    target.write_text("old")
    LocalStorage().write_atomically(str(target), "new")
    assert target.read_text() == "new"
    assert str(tmp_path) in fsynced
    assert os.listdir(tmp_path) == ["file.txt"]  # no temporary file left


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "data.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with local.atomic_output(target) as stream:
            stream.write(b"half of the new con")
            raise RuntimeError("the writer died")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["data.bin"]


def test_a_rank_s_checksum_record_is_written_durably_with_its_directory(tmp_path, fsynced):
    # Regression: the checksum file used to be renamed into place without a directory
    # fsync, so a crash right after a "complete" save could lose it.
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from megatron_async.writer.bucket_io import ChecksummedWriteResult

    where = _StorageInfo("__3_0.distcp", 0, 4)
    result = ChecksummedWriteResult(MetadataIndex("x", [0]), 4, where, checksum="ab")
    checksums.write_rank_record(str(tmp_path), 3, [result])
    assert str(tmp_path) in fsynced
    assert checksums.read_checksum_file(str(tmp_path), fmt.checksum_record_name(3))[0].digest == "ab"
    assert sorted(os.listdir(tmp_path)) == [fmt.checksum_record_name(3)]
    assert fmt.is_checksum_record(fmt.checksum_record_name(3))
    assert not fmt.is_checksum_record("megatron_async_checksums.json")
    # The same rank saving again without checksums leaves no record of other bytes.
    checksums.write_rank_record(str(tmp_path), 3, [dataclasses.replace(result, checksum=None)])
    assert os.listdir(tmp_path) == []


def test_commit_writes_only_the_metadata_with_a_directory_fsync(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.metadata import Metadata

    from megatron_async.writer import commit

    order = []
    real_write = LocalStorage.write_atomically

    def record(self, path, data):
        order.append(os.path.basename(path))
        real_write(self, path, data)

    monkeypatch.setattr(LocalStorage, "write_atomically", record)
    commit.commit_checkpoint(str(tmp_path), Metadata(state_dict_metadata={}), [[]], None)
    assert order == [fmt.DCP_METADATA_FILE]  # the ranks' writers record the checksums
    with open(tmp_path / fmt.DCP_METADATA_FILE, "rb") as stream:
        assert isinstance(pickle.load(stream), Metadata)


def test_completion_markers_are_removed_before_an_overwrite(tmp_path, fsynced):
    for name in fmt.COMPLETION_MARKERS:
        (tmp_path / name).write_text("{}")
    storage = LocalStorage()
    assert not fmt.missing_completion_markers(tmp_path, storage)
    assert sorted(fmt.remove_completion_markers(tmp_path, storage)) == sorted(fmt.COMPLETION_MARKERS)
    assert fmt.missing_completion_markers(tmp_path, storage)
    assert str(tmp_path) in fsynced
    assert fmt.remove_completion_markers(tmp_path, storage) == []

