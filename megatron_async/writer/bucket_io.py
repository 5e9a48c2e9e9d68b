"""Write one staged bucket to its file in DCP's byte layout, hashed on the way.

Runs in the background writer (a thread of the persistent worker or of a forked writer);
:func:`write_bucket` says how.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _write_item
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.buckets.bucket_file import BucketFile, OpenedBucketFile
from megatron_async.buckets.layout import WriteBucket, is_empty_chunk
from megatron_async.buckets.direct_io import ChunkPool, LocalBucketFile
from megatron_async.core.one_per_process import OnePerProcess
from megatron_async.writer.tensor_archive import tensor_bytes, tensor_frame

__all__ = ["BounceChunks", "ChecksummedWriteResult", "write_bucket"]


def _write_item_kwargs() -> Dict[str, Any]:
    params = inspect.signature(_write_item).parameters
    if "serialization_format" not in params:
        return {}
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    return {"serialization_format": SerializationFormat.TORCH_SAVE}


_WRITE_ITEM_KWARGS = _write_item_kwargs()


@dataclasses.dataclass(frozen=True)
class ChecksummedWriteResult(WriteResult):
    """A DCP ``WriteResult`` that also carries the xxh3 digest of the item's stored bytes.

    ``checksum`` is None when the writer computes no checksums. ``empty_chunk`` tells a
    tensor chunk without elements, which several ranks may write at one offset (the
    commit keeps the chunk with data: :mod:`megatron_async.writer.commit`).

    Pickles as one flat tuple of plain values: results cross from the background writer
    to the trainer and are gathered on the coordinator, where unpickling tens of
    thousands of nested dataclasses (each with a state dict, a ``MetadataIndex`` and a
    ``_StorageInfo``) would dominate the finalization on the training thread.
    """

    checksum: Optional[str] = None
    empty_chunk: bool = False

    def __reduce__(self):
        storage, index = self.storage_data, self.index
        if type(storage) is not _StorageInfo or storage.transform_descriptors is not None:
            return (
                ChecksummedWriteResult,
                (index, self.size_in_bytes, storage, self.checksum, self.empty_chunk),
            )
        # The offset itself, not a tuple of it: a rank's plan shares one object per distinct
        # offset (saver/global_metadata.py, share_equal_sizes), which pickle then writes once per rank.
        return (
            _rebuild_checksummed_result,
            (
                index.fqn, index.offset, index.index, self.size_in_bytes,
                storage.relative_path, storage.offset, storage.length, self.checksum,
                self.empty_chunk,
            ),
        )


def _rebuild_checksummed_result(
    fqn: str,
    chunk_offsets: Optional[Sequence[int]],
    index_hint: Optional[int],
    size_in_bytes: int,
    relative_path: str,
    offset: int,
    length: int,
    checksum: Optional[str],
    empty_chunk: bool,
) -> ChecksummedWriteResult:
    index = MetadataIndex(fqn, None, index_hint)
    if chunk_offsets is not None:  # kept as the object it is, to stay shared (see __reduce__)
        if type(chunk_offsets) is not torch.Size:
            chunk_offsets = torch.Size(chunk_offsets)
        object.__setattr__(index, "offset", chunk_offsets)
    return ChecksummedWriteResult(
        index,
        size_in_bytes,
        _StorageInfo(relative_path, offset, length),
        checksum,
        empty_chunk,
    )


def _append_raw_item(file: BucketFile, item: WriteItem, data: Any) -> bool:
    """Append one item in DCP's torch_save layout without ``torch.save``, if it can be.

    A bytes item is its buffer; a tensor item is frame head, the tensor's own memory,
    frame tail (:mod:`megatron_async.writer.tensor_archive`). Returns False, having
    written nothing, for a tensor that needs ``torch.save``.
    """
    if item.type == WriteItemType.BYTE_IO:
        file.append(data.getbuffer())
        return True
    frame = tensor_frame(data)
    if frame is None:
        return False
    file.append(frame[0], tensor_bytes(data), frame[1])
    return True


def _saves_more_than_itself(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()


class BounceChunks(ChunkPool, OnePerProcess):
    """The bounce chunks this process's local bucket files reuse; a forked writer gets a
    pool of its own (measured: 20 ms less writer CPU per warm save at 2 ranks x 123 MiB)."""

    fresh_in_forked_child = True


def write_bucket(
    transforms: Any,
    bucket: WriteBucket,
    use_fsync: bool,
    compute_checksums: bool = True,
    open_file: Optional[Callable[..., Any]] = None,
    direct_io: bool = True,
) -> List[WriteResult]:
    """Write one staged bucket to its file in DCP's byte layout and return its results.

    Every tensor item is the ``torch.save`` archive of the tensor, as DCP's ``torch_save``
    format stores it, so any DCP reader can read the file. Plain CPU tensors are framed
    directly (:mod:`megatron_async.writer.tensor_archive`); other tensors, and every item
    when the writer has stream transforms (DCP extensions), go through DCP's own item
    writer. Every result is a :class:`ChecksummedWriteResult`.

    Args:
        transforms: the writer's ``_StorageWriterTransforms`` (stream extensions).
        bucket: a staged bucket: every tensor must be on the CPU, and no tensor may
            change until this function returns.
        use_fsync: flush the file to stable storage before returning.
        compute_checksums: record an xxh3 digest of every item, hashed on its way to
            the file (no second read).
        open_file: opens the file (``open_file(path, "wb")``) when it is not the built-in
            ``open``: how object stores plug in. None or ``open``: direct system calls.
            An opener with an ``open_bucket_file(path, hashing)`` method (our object-store
            opener) gives the bucket file itself: a streamed upload that is abandoned
            (aborted) if closed before ``finish``.
        direct_io: write a local file with ``O_DIRECT`` where the file system accepts
            it (:mod:`megatron_async.buckets.direct_io`); False writes through the page
            cache. Ignored with an ``open_file``.

    Raises:
        ValueError: a tensor is not on the CPU (the bucket was not staged).
        OSError: the file could not be written.
    """
    bytes_data, tensor_data = bucket.data
    raw_layout = not getattr(transforms, "extensions", None)
    results: List[WriteResult] = []
    open_bucket_file = getattr(open_file, "open_bucket_file", None)
    if open_bucket_file is not None:
        file = open_bucket_file(bucket.file_path, compute_checksums)
    elif open_file is None or open_file is open:
        file = LocalBucketFile(bucket.file_path, compute_checksums, direct_io, BounceChunks.of_process())
    else:
        file = OpenedBucketFile(bucket.file_path, compute_checksums, open_file)
    try:

        def write(item: WriteItem, data: Any) -> None:
            file.start_item()
            offset = file.tell()
            if raw_layout and _append_raw_item(file, item, data):
                length = file.tell() - offset
                index, storage = item.index, _StorageInfo(bucket.file_name, offset, length)
            else:
                if isinstance(data, torch.Tensor) and _saves_more_than_itself(data):
                    data = data.clone()  # as DCP's writer does: torch.save writes whole storages
                try:
                    result = _write_item(
                        transforms, file, data, item, bucket.file_name, **_WRITE_ITEM_KWARGS
                    )
                except Exception as exc:
                    if file.write_error is not None:  # the real cause, e.g. ENOSPC
                        raise file.write_error from exc
                    raise
                index, length, storage = result.index, result.size_in_bytes, result.storage_data
            results.append(
                ChecksummedWriteResult(
                    index, length, storage, file.finish_item(), is_empty_chunk(item)
                )
            )

        for item, data in bytes_data:
            write(item, data)
        # Items copied after the hand-over (staging.gate): wait for each, free it after.
        before_item = getattr(tensor_data, "before_item", None)
        after_item = getattr(tensor_data, "after_item", None)
        try:
            for idx, (item, tensor) in enumerate(tensor_data):
                if not tensor.is_cpu:
                    raise ValueError(
                        f"{item.index.fqn} is on {tensor.device}; run the request's "
                        "preload_fn (staging) before the save function"
                    )
                if before_item is not None:
                    before_item(idx)
                write(item, tensor)
                if after_item is not None:  # the file copied the item: its memory may go
                    after_item(idx)
        except BaseException as exc:
            abandon = getattr(tensor_data, "abandon", None)
            if abandon is not None:  # in rounds: nobody waits for this bucket's items
                abandon(exc)
            raise
        file.finish(use_fsync)
    finally:
        file.close()
    return results
