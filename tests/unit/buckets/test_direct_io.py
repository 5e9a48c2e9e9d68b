"""Direct I/O bucket files: same bytes and digests as buffered files, fallbacks, errors.

The other writer tests already write through direct I/O (it is the default wherever the
test directory's file system accepts ``O_DIRECT``); these pin down what is particular to
it: pieces crossing the bounce chunk, the padded last chunk cut to size, the two
fallbacks to buffered writes, and that a full disk still reads as ENOSPC.
"""

from __future__ import annotations

import errno
import fcntl
import os

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

from megatron_async.integrity import checksums
from megatron_async.buckets import bucket_file, direct_io
from megatron_async.buckets.bucket_file import BucketFile
from megatron_async.writer.bucket_io import write_bucket
from tests.unit.writer.test_write_buckets import _bucket, _mixed_tensors

pytestmark = pytest.mark.timeout(120)

_CHUNK = 64 * 1024
"""A small bounce chunk, so that tests cross it often."""

_HASH_BLOCK = 24 * 1024
"""A copy-and-hash block that divides neither the chunk nor the pieces."""


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(bucket_file, "CHUNK_BYTES", _CHUNK)
    monkeypatch.setattr(bucket_file, "_HASH_BLOCK_BYTES", _HASH_BLOCK)


def _direct_io_works(directory) -> bool:
    try:
        fd = os.open(os.path.join(directory, "probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def _pieces():
    sizes = [1, 4095, 4097, _CHUNK - 3, _CHUNK, 3 * _CHUNK + 17, 0, 12345]
    return [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]


def _write_items(file: BucketFile, pieces):
    digests, offsets = [], []
    for piece in pieces:
        file.start_item()
        offsets.append(file.tell())
        file.append(piece[: len(piece) // 2], memoryview(piece)[len(piece) // 2 :])
        digests.append(file.finish_item())
    file.write(b"tail written through the stream interface")
    file.finish(use_fsync=True)
    file.close()
    return digests, offsets


def _digest(data: bytes) -> str:
    hasher = checksums.new_hasher()
    hasher.update(data)
    return hasher.hexdigest()


def test_a_direct_file_holds_exactly_the_appended_bytes(tmp_path, small_chunks):
    if not _direct_io_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    path = str(tmp_path / "f")
    file = direct_io.LocalBucketFile(path, hashing=True, direct_io=True)
    assert fcntl.fcntl(file._fd, fcntl.F_GETFL) & os.O_DIRECT
    pieces = _pieces()
    digests, offsets = _write_items(file, pieces)
    assert file.writes_direct
    expected = b"".join(pieces) + b"tail written through the stream interface"
    assert (tmp_path / "f").read_bytes() == expected  # the padding was cut off
    assert digests == [_digest(p) for p in pieces]
    assert offsets == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]


def test_direct_and_buffered_buckets_are_byte_identical(tmp_path):
    tensors = _mixed_tensors()
    outputs = {}
    for mode in (True, False):
        path = tmp_path / f"{mode}.distcp"
        results = write_bucket(_StorageWriterTransforms(), _bucket(path, tensors), True, direct_io=mode)
        outputs[mode] = (path.read_bytes(), [(r.storage_data.offset, r.checksum) for r in results])
    assert outputs[True] == outputs[False]


def test_a_file_system_refusing_direct_io_at_open_gets_a_buffered_file(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", refusing_open)
    file = direct_io.LocalBucketFile(str(tmp_path / "f"), hashing=True, direct_io=True)
    assert not file.writes_direct
    pieces = _pieces()
    _write_items(file, pieces)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces) + b"tail written through the stream interface"


def test_a_file_system_refusing_direct_writes_is_written_buffered(tmp_path, monkeypatch, small_chunks):
    if not _direct_io_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    real_write = os.write
    refused = []

    def refusing_write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", refusing_write)
    file = direct_io.LocalBucketFile(str(tmp_path / "f"), hashing=False, direct_io=True)
    pieces = _pieces()
    _write_items(file, pieces)
    assert refused == [_CHUNK]  # the first chunk; the flag was cleared after it
    assert not file.writes_direct
    assert (tmp_path / "f").read_bytes() == b"".join(pieces) + b"tail written through the stream interface"


def test_a_full_disk_during_a_direct_write_raises_enospc(tmp_path, monkeypatch, small_chunks):
    if not _direct_io_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io.os, "write", full_disk)
    bucket = _bucket(tmp_path / "f.distcp", {"big": torch.randn(_CHUNK)})
    with pytest.raises(OSError) as excinfo:
        write_bucket(_StorageWriterTransforms(), bucket, True)
    assert excinfo.value.errno == errno.ENOSPC


def test_a_chunk_is_its_file_s_own_and_goes_with_it(tmp_path):
    """No chunk outlives its file, so none is inherited by a forked writer and filled
    again: a chunk shared with the trainer or a sibling writer would mix their bytes
    under each writer's own checksums."""
    first, second = (direct_io.LocalBucketFile(str(tmp_path / name), True) for name in "ab")
    assert first._chunk is not second._chunk
    for file in (first, second):
        file.close()
        assert file._chunk.closed


@pytest.mark.parametrize("direct", [True, False])
def test_the_writer_option_reaches_the_bucket_files(tmp_path, monkeypatch, direct):
    from megatron_async.writer import bucket_io
    from tests.unit.writer.test_write_buckets import _save

    asked = []
    real = bucket_io.LocalBucketFile

    def recording(path, hashing, direct_io, chunks):
        asked.append(direct_io)
        return real(path, hashing, direct_io, chunks)

    monkeypatch.setattr(bucket_io, "LocalBucketFile", recording)
    state_dict = {"w": torch.randn(64, 8), "b": torch.randn(8)}
    _save(tmp_path, state_dict, direct_io=direct)
    assert asked and set(asked) == {direct}


def test_the_strategy_option_reaches_its_writer(tmp_path):
    from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy

    assert TorchDistAsyncSaveStrategy()._create_writer(str(tmp_path)).options.direct_io is True
    writer = TorchDistAsyncSaveStrategy(direct_io=False)._create_writer(str(tmp_path))
    assert writer.options.direct_io is False
