"""Object storage pieces on a loopback S3 endpoint: streaming, multipart, abort, errors."""

import os
import sys

import pytest

from megatron_async.errors import CheckpointValidationError, ObjectStoreError, ObjectStoreUnavailableError
from megatron_async.storage import is_object_url, normalize_checkpoint_path
from tests.object_store import object_store_skip_reason
from tests.unit.storage.conftest import BUCKET

PART = 5 << 20

needs_store = pytest.mark.skipif(object_store_skip_reason() is not None, reason=str(object_store_skip_reason()))


def test_urls_keep_their_profile_and_local_paths_become_absolute():
    assert normalize_checkpoint_path("msc://p/run/iter_1/") == "msc://p/run/iter_1"
    assert normalize_checkpoint_path(os.fspath(__import__("pathlib").Path("msc://p/x"))) == "msc://p/x"
    assert normalize_checkpoint_path("rel") == os.path.abspath("rel")
    assert is_object_url("msc://p/x") and not is_object_url("/tmp/x")


def test_use_msc_without_the_extra_names_it(monkeypatch):
    from megatron_async.writer.filesystem import FileSystemWriterAsync

    monkeypatch.setitem(sys.modules, "multistorageclient", None)  # import fails
    with pytest.raises(ObjectStoreUnavailableError, match=r"pip install megatron-async\[msc\]"):
        FileSystemWriterAsync("msc://p/x", use_msc=True)
    from megatron_async.mcore.config import TorchDistSaveConfig

    with pytest.raises(ObjectStoreUnavailableError, match=r"megatron-async\[msc\]"):
        TorchDistSaveConfig(use_msc=True)


def test_an_object_url_without_use_msc_is_refused():
    from megatron_async.writer.filesystem import FileSystemWriterAsync

    with pytest.raises(CheckpointValidationError, match="use_msc=True"):
        FileSystemWriterAsync("msc://p/x")


def _open(url):
    from megatron_async.storage.stream import ObjectStoreFileOpener

    return ObjectStoreFileOpener(part_bytes=PART).open_bucket_file(url, True)


@needs_store
def test_a_large_bucket_is_a_multipart_upload_hashed_on_the_way(store):
    from megatron_async.integrity import checksums
    from megatron_async.storage.objects import ObjectStorage

    data = os.urandom(PART * 2 + 12345)
    out = _open("msc://unit/stream/big.distcp")
    out.start_item()
    out.append(memoryview(data)[:1000], memoryview(data)[1000:])
    digest = out.finish_item()
    assert len(store.list_multipart_uploads(Bucket=BUCKET)["Uploads"]) == 1  # streaming, not buffered
    out.finish(True)
    out.close()
    assert ObjectStorage().read("msc://unit/stream/big.distcp") == data
    hasher = checksums.new_hasher()
    hasher.update(data)
    assert digest == hasher.hexdigest()
    assert not store.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


@needs_store
def test_a_small_bucket_is_one_put(store):
    from megatron_async.storage.objects import ObjectStorage

    out = _open("msc://unit/stream/small.distcp")
    out.append(b"abc", b"def")
    out.finish(True)
    out.close()
    assert ObjectStorage().read("msc://unit/stream/small.distcp") == b"abcdef"


@needs_store
def test_closing_an_unfinished_upload_aborts_it(store):
    from megatron_async.storage.objects import ObjectStorage

    out = _open("msc://unit/stream/aborted.distcp")
    out.append(os.urandom(PART + 1))
    assert store.list_multipart_uploads(Bucket=BUCKET)["Uploads"]
    out.close()
    assert not store.list_multipart_uploads(Bucket=BUCKET).get("Uploads")
    assert not ObjectStorage().is_file("msc://unit/stream/aborted.distcp")


@needs_store
def test_a_missing_bucket_is_an_object_store_error_naming_the_url(store):
    out = _open("msc://unit_nobucket/x/file.distcp")
    out.append(b"x")
    with pytest.raises(ObjectStoreError, match="msc://unit_nobucket/x/file.distcp"):
        out.finish(True)
    out.close()


@needs_store
def test_small_objects_listing_and_completion_markers(store):
    from megatron_async.checkpoint_dirs import is_complete_checkpoint
    from megatron_async.format import remove_completion_markers
    from megatron_async.storage import storage_for

    url = "msc://unit/ckpt/iter_0000001"
    storage = storage_for(url)
    assert not is_complete_checkpoint(url, storage)
    storage.write_atomically(url + "/.metadata", b"m")
    storage.write_atomically(url + "/metadata.json", "{}")
    assert is_complete_checkpoint(url, storage)
    assert [name for name, _ in storage.list_dir(url)] == [".metadata", "metadata.json"]
    assert storage.list_dir("msc://unit/ckpt") == [("iter_0000001", None)]
    assert sorted(remove_completion_markers(url, storage)) == [".metadata", "metadata.json"]
    assert not is_complete_checkpoint(url, storage)


def test_dcp_planning_requests_of_the_writer_are_bounded(store):
    from megatron_async.storage.bounded_calls import BoundedFileSystem
    from megatron_async.writer.filesystem import FileSystemWriterAsync
    from megatron_async.writer.options import WriteOptions

    options = WriteOptions(use_msc=True, object_request_timeout_s=7.0)
    writer = FileSystemWriterAsync("msc://unit/bounded", options=options)
    assert isinstance(writer.fs, BoundedFileSystem) and writer.fs._timeout_s == 7.0
    writer.fs.mkdir(writer.path)  # DCP's prepare_local_plan: the folder, then an existing .metadata
    assert writer.fs.exists(writer.fs.concat_path(writer.path, ".metadata")) is False
