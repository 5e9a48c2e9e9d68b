"""The bucket writer: torch_save items without torch.save, few system calls, typed errors.

Files written by the fast path must stay PyTorch DCP's ``torch_save`` layout: every item
loads back through ``torch.distributed.checkpoint.load`` and, on its own, through
``torch.load``; checksums cover exactly the stored bytes.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    _StorageInfo,
    _StorageWriterTransforms,
)
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_async.integrity import checksums
from megatron_async.writer import tensor_archive as _tensor_archive
from megatron_async.buckets import direct_io
from megatron_async.writer.bucket_io import ChecksummedWriteResult, write_bucket
from megatron_async.buckets.layout import WriteBucket
from megatron_async.writer.results import WriteOutcome
from megatron_async.errors import CheckpointIntegrityError, StorageWriteError
from megatron_async.writer.filesystem import FileSystemWriterAsync
from megatron_async.writer.options import WriteOptions
from megatron_async.integrity.verify import verify_checkpoint_integrity
from tests.unit.integrity.test_checksums import _tensor_item
from tests.unit.writer.test_filesystem_async import _prepare

pytestmark = pytest.mark.timeout(120)

_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.uint16,
    torch.float8_e4m3fn,
]
_SHAPES = [(), (1,), (7,), (3, 5), (2, 1, 4), (64, 33)]


def _tensor(shape, dtype) -> torch.Tensor:
    values = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32).reshape(-1)
    values = values[: torch.Size(shape).numel()].reshape(shape)
    if dtype == torch.bool:
        return values.remainder(2).to(torch.bool)
    if dtype == torch.uint16:
        return values.to(torch.int32).to(torch.uint16)
    return values.to(dtype)


def _forget_archive_layout():
    _tensor_archive._frames_usable.cache_clear()
    _tensor_archive._frame.cache_clear()


@pytest.fixture
def torch_save_without_crc():
    """``torch.save`` with CRC-32 off in this test process (restored afterwards).

    The frames are made again under it, without CRCs as well.
    """
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    _forget_archive_layout()
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)
        _forget_archive_layout()


def _saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _framed(tensor: torch.Tensor) -> bytes:
    frame = _tensor_archive.tensor_frame(tensor)
    assert frame is not None, f"{tensor.dtype} {tuple(tensor.shape)} took the slow path"
    return frame[0] + _tensor_archive.tensor_bytes(tensor).tobytes() + frame[1]


# -- the torch.save archive without torch.save -------------------------------------------


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_frames_are_byte_identical_to_torch_save_without_crc(dtype, torch_save_without_crc):
    for shape in _SHAPES:
        tensor = _tensor(shape, dtype)
        assert _framed(tensor) == _saved(tensor), f"{dtype} {shape}"


def test_frames_load_with_torch_load_while_crc_is_on():
    assert torch.serialization.get_crc32_options()  # nothing global was changed
    for dtype in _DTYPES:
        tensor = _tensor((4, 6), dtype)
        loaded = torch.load(io.BytesIO(_framed(tensor)), weights_only=True)
        assert loaded.dtype == dtype
        assert torch.equal(loaded.view(torch.uint8), tensor.view(torch.uint8))


def test_a_view_is_saved_as_its_own_bytes(torch_save_without_crc):
    base = torch.arange(1000, dtype=torch.float32)
    view = base[100:160].view(6, 10)
    archive = _framed(view)
    assert archive == _saved(view.clone())
    assert len(archive) < 1000 * 4  # not the whole storage, as torch.save(view) would write


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(3, requires_grad=True),
        lambda: torch.arange(12.0).view(3, 4).t(),
        lambda: torch.zeros(0, 4),
        lambda: torch.nn.Parameter(torch.ones(3), requires_grad=False),
        lambda: torch.arange(4.0).to(torch.complex64).conj(),
    ],
    ids=["requires_grad", "transposed", "empty", "parameter", "conj"],
)
def test_tensors_that_need_torch_save_take_the_slow_path(make):
    assert _tensor_archive.tensor_frame(make()) is None


# -- write_bucket ---------------------------------------------------------------------


def _mixed_tensors():
    tensors = {f"{dtype}".replace("torch.", ""): _tensor((5, 3), dtype) for dtype in _DTYPES}
    tensors["big"] = torch.randn(3 << 20)  # 12 MiB: written from its own memory
    tensors["view"] = torch.arange(100.0)[10:30]
    tensors["transposed"] = torch.arange(12.0).view(3, 4).t()
    tensors["empty"] = torch.zeros(0, 2)
    tensors["large_fallback"] = torch.randn(3 << 20).view(1024, 3072).t()  # torch.save, 12 MiB
    return tensors


def _bucket(path, tensors, blob=b"a pickled object" * 10):
    items = [(WriteItem(index=MetadataIndex("obj"), type=WriteItemType.BYTE_IO), io.BytesIO(blob))]
    name = os.path.basename(path)
    return WriteBucket(str(path), name, (items, [(_tensor_item(k, v), v) for k, v in tensors.items()]))


def test_every_item_loads_back_alone_and_its_checksum_covers_its_bytes(tmp_path):
    tensors = _mixed_tensors()
    bucket = _bucket(tmp_path / "__0_0.distcp", tensors)
    results = write_bucket(_StorageWriterTransforms(), bucket, True)
    data = (tmp_path / "__0_0.distcp").read_bytes()
    assert len(results) == len(tensors) + 1
    assert sum(r.storage_data.length for r in results) == len(data)
    for result in results:
        info = result.storage_data
        stored = data[info.offset : info.offset + info.length]
        hasher = checksums.new_hasher()
        hasher.update(stored)
        assert result.checksum == hasher.hexdigest()
        if result.index.fqn == "obj":
            assert stored == b"a pickled object" * 10
            continue
        loaded = torch.load(io.BytesIO(stored), weights_only=True)
        assert torch.equal(loaded, tensors[result.index.fqn]), result.index.fqn


def test_without_usable_frames_every_item_goes_through_torch_save(tmp_path, monkeypatch, request):
    _forget_archive_layout()
    monkeypatch.setattr(_tensor_archive, "_frames_usable", lambda: False)
    request.addfinalizer(_tensor_archive._frame.cache_clear)  # none of its None frames stay
    tensors = {"a": torch.randn(7, 3), "b": torch.arange(10, dtype=torch.int64)}
    bucket = _bucket(tmp_path / "f.distcp", tensors)
    results = write_bucket(_StorageWriterTransforms(), bucket, True)
    data = (tmp_path / "f.distcp").read_bytes()
    for result in results[1:]:
        info = result.storage_data
        stored = data[info.offset : info.offset + info.length]
        assert torch.equal(torch.load(io.BytesIO(stored)), tensors[result.index.fqn])
        hasher = checksums.new_hasher()
        hasher.update(stored)
        assert result.checksum == hasher.hexdigest()


def test_short_writes_are_resumed_where_they_stopped(tmp_path, monkeypatch):
    target = direct_io.LocalBucketFile(str(tmp_path / "f"), hashing=True, direct_io=False)
    real_write = os.write

    def short_write(fd, data):  # the file takes at most 5 bytes per system call
        return real_write(fd, bytes(data[:5]) if fd == target._fd else data)

    monkeypatch.setattr(direct_io.os, "write", short_write)
    expected = b""
    for i in range(20):
        piece = bytes(range(i, i + 13))
        target.append(piece, memoryview(piece[::-1]))
        expected += piece + piece[::-1]
    target.write(b"written through the stream interface")
    expected += b"written through the stream interface"
    target.finish(use_fsync=False)
    target.close()
    assert (tmp_path / "f").read_bytes() == expected


def test_results_pickle_flat_and_come_back_equal():
    results = [
        ChecksummedWriteResult(MetadataIndex("a", [0, 4], 3), 10, _StorageInfo("f", 7, 10), "ab"),
        ChecksummedWriteResult(MetadataIndex("obj"), 5, _StorageInfo("f", 17, 5), None),
    ]
    payload = pickle.loads(pickle.dumps(WriteOutcome(rank=1, results={0: results}).payload()))
    assert payload[0] == results
    index = payload[0][0].index
    assert index.index == 3 and isinstance(index.offset, torch.Size)
    assert b"MetadataIndex" not in pickle.dumps(results)  # one flat tuple per result


# -- the whole writer -----------------------------------------------------------------


def _save(path, state_dict, **options):
    writer = FileSystemWriterAsync(str(path), options=WriteOptions(thread_count=2, **options))
    dcp.save(state_dict, storage_writer=writer, no_dist=True)


def test_a_save_loads_back_equal_through_dcp_and_every_item_through_torch_load(tmp_path):
    state_dict = _mixed_tensors()
    _save(tmp_path, state_dict)
    out = {k: torch.empty_like(v) for k, v in state_dict.items()}
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    for key, tensor in state_dict.items():
        assert torch.equal(out[key], tensor), key
    metadata = FileSystemReader(str(tmp_path)).read_metadata()
    for index, info in metadata.storage_data.items():
        with open(tmp_path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            item = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        assert torch.equal(item, state_dict[index.fqn]), index.fqn


def test_recorded_checksums_verify_and_a_flipped_byte_is_named(tmp_path):
    state_dict = {"w": torch.randn(256, 64), "b": torch.randn(64)}
    _save(tmp_path, state_dict)
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    verify_checkpoint_integrity(str(tmp_path), require_checksums=True)

    items = {i.fqn: i for i in checksums.read_checksums(str(tmp_path))}
    target = items["w"]
    with open(tmp_path / target.file, "r+b") as f:
        f.seek(target.offset + target.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointIntegrityError, match=r"w .*checksum mismatch"):
        verify_checkpoint_integrity(str(tmp_path))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize(
    "tensor",
    [torch.randn(64), torch.randn(3 << 20).view(1024, 3072).t(), torch.arange(6.0).view(2, 3).t()],
    ids=["framed", "torch.save, large", "torch.save, small"],
)
def test_a_full_disk_raises_enospc(tmp_path, tensor):
    bucket = _bucket(tmp_path / "unused", {"t": tensor})
    bucket = bucket._replace(file_path="/dev/full")
    with pytest.raises(OSError) as excinfo:
        write_bucket(_StorageWriterTransforms(), bucket, False)
    assert excinfo.value.errno == errno.ENOSPC


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_reaches_the_trainer_as_a_storage_write_error(tmp_path):
    os.symlink("/dev/full", tmp_path / "__0_0.distcp")
    state_dict = {"a": torch.randn(1000)}
    writer = FileSystemWriterAsync(str(tmp_path))
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=True)
    writer.set_up_storage_writer(True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    planner.create_global_plan([local_plan])
    plan = planner.finish_plan(writer.prepare_decentralized_global_plan(local_plan))
    writer.prepare_write_data(plan, planner)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    save_fn(args[0], preload_fn(), args[2])  # the background part, here synchronously
    exc, _ = writer.retrieve_write_results()  # DCP's wrapped exception, returned
    assert isinstance(exc, StorageWriteError) and "No space left" in str(exc)
    assert isinstance(exc.failure.exception(), OSError)


def test_a_forked_writer_inherits_the_frames_the_trainer_made(tmp_path, request):
    """The temporal caller's writer is a fresh fork per save: it must find every frame (and
    the probe's verdict) made by the trainer's prepare step, not build them itself."""
    _forget_archive_layout()
    request.addfinalizer(_forget_archive_layout)
    state_dict = {
        "w": torch.randn(48, 40), "b": torch.arange(40, dtype=torch.int64), "h": torch.randn(5, 3, 2),
    }
    writer = FileSystemWriterAsync(str(tmp_path))
    metadata = _prepare(writer, state_dict)  # the trainer's prepare step makes the frames
    assert _tensor_archive._frame.cache_info().currsize == len(state_dict)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    staged = preload_fn()
    pid = os.fork()
    if pid == 0:  # the forked writer: torch.save is not there, every item must be framed
        code = 1
        try:
            def no_torch_save(*_args, **_kwargs):
                raise AssertionError("torch.save called in the forked writer")

            torch.save = no_torch_save
            misses = _tensor_archive._frame.cache_info().misses
            save_fn(args[0], staged, args[2])
            code = 0 if _tensor_archive._frame.cache_info().misses == misses else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    writer.finish(metadata, [writer.retrieve_write_results()])
    out = {k: torch.empty_like(v) for k, v in state_dict.items()}
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    for key, tensor in state_dict.items():
        assert torch.equal(out[key], tensor), key


def test_bounce_chunks_are_reused_within_a_process_and_never_across_a_fork(tmp_path):
    """A fresh chunk's first fill costs page faults (about 4 ms per 8 MiB), so the local
    files of one process reuse its pool's chunks; a forked writer takes none of its
    parent's spares (two processes never fill one chunk)."""
    from megatron_async.buckets import direct_io
    from megatron_async.writer.bucket_io import BounceChunks

    pool = BounceChunks.of_process()
    first = direct_io.LocalBucketFile(str(tmp_path / "a"), True, True, pool)
    chunk = first._chunk
    first.append(b"x" * 100)
    first.finish(use_fsync=False)
    first.close()
    second = direct_io.LocalBucketFile(str(tmp_path / "b"), True, True, pool)
    assert second._chunk is chunk
    second.close()
    pid = os.fork()
    if pid == 0:
        try:
            child = BounceChunks.of_process()
            mine = direct_io.LocalBucketFile(str(tmp_path / "c"), True, True, child)
            os._exit(0 if child is not pool and mine._chunk is not chunk else 3)
        except BaseException:
            os._exit(4)
    assert os.waitpid(pid, 0)[1] == 0
    assert (tmp_path / "a").read_bytes() == b"x" * 100
