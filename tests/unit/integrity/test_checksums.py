"""Checksums are computed while writing and catch truncation and bit flips."""

import io
import os

import pytest
import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megatron_async.integrity import checksums
from megatron_async.writer.bucket_io import ChecksummedWriteResult, write_bucket
from megatron_async.buckets.layout import WriteBucket
from megatron_async.errors import CheckpointIntegrityError
from megatron_async.format import checksum_record_name
from megatron_async.integrity.verify import verify_checkpoint_integrity

pytestmark = pytest.mark.timeout(60)


def _tensor_item(fqn: str, tensor: torch.Tensor) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, [0] * tensor.dim()),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.shape),
            properties=TensorProperties.create_from_tensor(tensor),
            size=tensor.shape,
        ),
    )


def _write(tmp_path, compute_checksums=True):
    tensors = {"a": torch.randn(64, 16), "b": torch.arange(100, dtype=torch.int64)}
    blob = io.BytesIO(b"some pickled object" * 10)
    blob_item = WriteItem(index=MetadataIndex("obj"), type=WriteItemType.BYTE_IO)
    bucket = WriteBucket(
        str(tmp_path / "__0_0.distcp"),
        "__0_0.distcp",
        ([(blob_item, blob)], [(_tensor_item(k, v), v) for k, v in tensors.items()]),
    )
    return write_bucket(_StorageWriterTransforms(), bucket, True, compute_checksums)


def _items(results):
    return [
        checksums.ItemChecksum(
            r.storage_data.relative_path, r.storage_data.offset, r.storage_data.length, r.checksum, r.index.fqn
        )
        for r in results
    ]


def test_digest_covers_exactly_the_stored_bytes(tmp_path):
    results = _write(tmp_path)
    assert all(isinstance(r, ChecksummedWriteResult) for r in results)
    data = (tmp_path / "__0_0.distcp").read_bytes()
    for r in results:
        info = r.storage_data
        assert r.checksum == xxhash.xxh3_64(data[info.offset : info.offset + info.length]).hexdigest()


def test_checksums_can_be_switched_off(tmp_path):
    results = _write(tmp_path, compute_checksums=False)
    assert results and all(r.checksum is None for r in results)


def test_bit_flip_and_truncation_are_reported_with_file_and_item(tmp_path):
    results = _write(tmp_path)
    items = _items(results)
    checksums.write_rank_record(str(tmp_path), 0, results)
    recorded = checksums.read_checksum_file(str(tmp_path), checksum_record_name(0))
    assert [(i.file, i.offset, i.digest) for i in recorded] == sorted((i.file, i.offset, i.digest) for i in items)
    assert checksums.verify_items(str(tmp_path), items) == []

    target = max(items, key=lambda i: i.length)
    path = tmp_path / "__0_0.distcp"
    with open(path, "r+b") as f:
        f.seek(target.offset + target.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    problems = checksums.verify_items(str(tmp_path), items)
    assert len(problems) == 1 and "checksum mismatch" in problems[0]
    assert target.fqn in problems[0] and "__0_0.distcp" in problems[0]

    with open(path, "r+b") as f:
        f.truncate(target.offset + 1)
    problems = checksums.verify_items(str(tmp_path), items)
    assert any("truncated" in p for p in problems)


def test_single_process_integrity_check_names_damage(tmp_path):
    checksums.write_rank_record(str(tmp_path), 0, _write(tmp_path))
    with pytest.raises(CheckpointIntegrityError, match="metadata.json is missing"):
        verify_checkpoint_integrity(str(tmp_path))
