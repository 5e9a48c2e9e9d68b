"""Write one staged bucket to its file: DCP's byte layout, few system calls, hashed on the way.

Runs in the background writer (a thread of the persistent worker, a forked writer, or a
bucket process). Every item lands in DCP's ``torch_save`` layout, so stock readers read
the file; plain CPU tensors are framed without ``torch.save``
(:mod:`.tensor_archive`), and every item's bytes are hashed with xxh3 while they are
written (:mod:`megatron_async.integrity.checksums`).
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _write_item
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.integrity import checksums
from megatron_async.writer.buckets import WriteBucket, is_empty_chunk
from megatron_async.writer.tensor_archive import tensor_bytes, tensor_frame

__all__ = ["ChecksummedWriteResult", "BucketFile", "OpenedBucketFile", "OpenBucketFile", "write_bucket"]

logger = logging.getLogger(__name__)


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
    tensor chunk without elements: with uneven splits several ranks write one at the same
    offset, sometimes at the offset of another rank's chunk with data, and the commit
    must point the metadata at the chunk with data (see
    :func:`megatron_async.writer.commit.commit_checkpoint`).

    Pickles as one flat tuple of plain values: results cross from the background writer
    to the trainer and are gathered on the coordinator, where unpickling tens of
    thousands of nested dataclasses (each with a state dict, a ``MetadataIndex`` and a
    ``_StorageInfo``) used to dominate the finalization on the training thread.
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
        chunk_offsets = None if index.offset is None else tuple(index.offset)
        return (
            _rebuild_checksummed_result,
            (
                index.fqn, chunk_offsets, index.index, self.size_in_bytes,
                storage.relative_path, storage.offset, storage.length, self.checksum,
                self.empty_chunk,
            ),
        )


def _rebuild_checksummed_result(
    fqn: str,
    chunk_offsets: Optional[Tuple[int, ...]],
    index_hint: Optional[int],
    size_in_bytes: int,
    relative_path: str,
    offset: int,
    length: int,
    checksum: Optional[str],
    empty_chunk: bool,
) -> ChecksummedWriteResult:
    return ChecksummedWriteResult(
        MetadataIndex(fqn, chunk_offsets, index_hint),
        size_in_bytes,
        _StorageInfo(relative_path, offset, length),
        checksum,
        empty_chunk,
    )


_GATHER_BYTES = 8 << 20
"""Pieces are gathered until this many bytes are pending, then written with one ``writev``."""

_GATHER_PIECES = 512
"""At most this many pieces per ``writev`` (the system's limit, IOV_MAX, is usually 1024)."""

_WRITEBACK_BYTES = 16 << 20
"""After every this many written bytes, the kernel is asked to start writing them back."""


class BucketFile:
    """One bucket's file, written with few large system calls, every item hashed on its way.

    Runs in the background writer. Items are appended one after the other, between
    :meth:`start_item` and :meth:`finish_item` (which returns the item's digest).

    * :meth:`append` keeps a reference to the caller's memory instead of copying it: the
      tensors of a staged bucket and the cached archive frames stay valid until the file
      is finished. Pending pieces are written together with one ``writev`` once
      :data:`_GATHER_BYTES` are pending, so no byte is copied in user space.
    * :meth:`write`, :meth:`tell` and :meth:`flush` make the object a stream for DCP's
      item writer (``torch.save``); :meth:`write` copies, since ``torch.save`` reuses
      its buffers.
    * Every :data:`_WRITEBACK_BYTES`, ``posix_fadvise(DONTNEED)`` starts the writeback of
      the finished range, so the disk works while later items are prepared and the final
      fsync has little left to wait for; it also keeps the checkpoint out of the page
      cache.

    Attributes:
        write_error: the first ``OSError`` raised while ``torch.save`` was writing.
            ``torch.save`` swallows the exceptions of a stream's ``write`` and reports
            only "unexpected pos"; the writer re-raises this one, so a full disk reads as
            ENOSPC.
    """

    def __init__(self, path: str, hashing: bool):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        self._start_stream(hashing)

    def _start_stream(self, hashing: bool) -> None:
        """Set up the gathering and hashing state (subclasses with another output call it)."""
        self._hasher = checksums.new_hasher() if hashing else None
        self._pending: List[Any] = []
        self._pending_bytes = 0
        self._written = 0
        self._writeback_start = 0
        self._advise = hasattr(os, "posix_fadvise")
        self.write_error: Optional[OSError] = None

    # -- items -------------------------------------------------------------------------

    def start_item(self) -> None:
        if self._hasher is not None:
            self._hasher.reset()

    def finish_item(self) -> Optional[str]:
        return self._hasher.hexdigest() if self._hasher is not None else None

    def append(self, *pieces: Any) -> None:
        """Append ``pieces`` (bytes or 1-D byte memoryviews), which must stay unchanged
        until :meth:`finish`."""
        for piece in pieces:
            size = len(piece)
            if size:
                if self._hasher is not None:
                    self._hasher.update(piece)
                self._pending.append(piece)
                self._pending_bytes += size
        if self._pending_bytes >= _GATHER_BYTES or len(self._pending) >= _GATHER_PIECES:
            self._write_pending()

    def finish(self, use_fsync: bool) -> None:
        """Write what is pending and, with ``use_fsync``, make the file durable."""
        self._write_pending()
        if use_fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)

    # -- the stream DCP's item writer sees ---------------------------------------------

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        """The file offset after everything appended so far."""
        return self._written + self._pending_bytes

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            # A large piece is written out before this returns (it fills the gathering
            # on its own), so only small pieces need a copy.
            self.append(view if view.nbytes >= _GATHER_BYTES else view.tobytes())
        except OSError as exc:
            if self.write_error is None:
                self.write_error = exc
            raise
        return view.nbytes

    def flush(self) -> None:
        """Do nothing: DCP flushes after every item, and a system call per item is what
        this class avoids. :meth:`finish` writes everything out."""

    # -- the file ----------------------------------------------------------------------

    def _write_pending(self) -> None:
        pieces, self._pending, self._pending_bytes = self._pending, [], 0
        while pieces:
            written = self._writev(pieces)
            if written == 0:
                raise OSError(errno.EIO, f"the file accepted no bytes at offset {self._written}")
            self._written += written
            done = 0
            while done < len(pieces) and written >= len(pieces[done]):
                written -= len(pieces[done])
                done += 1
            pieces = pieces[done:]
            if written:  # a short write ended inside pieces[0]
                pieces[0] = memoryview(pieces[0])[written:]
        if self._written - self._writeback_start >= _WRITEBACK_BYTES:
            self._start_writeback()

    def _writev(self, pieces: List[Any]) -> int:
        """Write ``pieces`` in order with one system call; may write less than all of them."""
        return os.writev(self._fd, pieces)

    def _start_writeback(self) -> None:
        if not self._advise:
            return
        try:
            os.posix_fadvise(
                self._fd, self._writeback_start, self._written - self._writeback_start,
                os.POSIX_FADV_DONTNEED,
            )
        except OSError as exc:  # not a regular file, or no such hint here: only slower
            logger.debug("posix_fadvise is not available for this file: %s", exc)
            self._advise = False
        self._writeback_start = self._written


class OpenedBucketFile(BucketFile):
    """A bucket's file opened by a caller-given ``open_file`` (object stores, custom I/O).

    Runs in the background writer. The same gathering and hashing as :class:`BucketFile`,
    but every system call goes through the stream ``open_file(path, "wb")`` returned:
    pieces are written with its ``write``, ``fsync`` applies only when the stream has a
    real file descriptor, and no page-cache hints are given.
    """

    def __init__(self, path: str, hashing: bool, open_file: Callable[..., Any]):
        self._stream = open_file(path, "wb")
        self._hasher = checksums.new_hasher() if hashing else None
        self._pending = []
        self._pending_bytes = 0
        self._written = 0
        self._writeback_start = 0
        self._advise = False
        self.write_error = None

    def finish(self, use_fsync: bool) -> None:
        self._write_pending()
        self._stream.flush()
        if use_fsync:
            try:
                fd = self._stream.fileno()
            except (AttributeError, OSError, ValueError):  # an object store: durable on close
                return
            os.fsync(fd)

    def close(self) -> None:
        self._stream.close()

    def _writev(self, pieces: List[Any]) -> int:
        written = 0
        for piece in pieces:
            count = self._stream.write(piece)
            written += len(piece) if count is None else count
            if count is not None and count < len(piece):
                break
        return written


def _append_raw_item(file: BucketFile, item: WriteItem, data: Any) -> bool:
    """Append one item in DCP's torch_save layout without ``torch.save``, if it can be.

    A bytes item is its buffer; a tensor item is the ``torch.save`` archive of the
    tensor: frame head, the tensor's own memory, frame tail (see
    :mod:`megatron_async.writer.tensor_archive`). Returns False, having written nothing, for a
    tensor that needs ``torch.save``.
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


OpenBucketFile = Callable[[str, bool], BucketFile]
"""``(file_path, hashing) -> BucketFile``: opens a bucket's output (a local file by default;
:func:`megatron_async.storage.stream.open_object_bucket_file` streams to an object store)."""


def write_bucket(
    transforms: Any,
    bucket: WriteBucket,
    use_fsync: bool,
    compute_checksums: bool = True,
    open_file: Optional[Callable[..., Any]] = None,
) -> List[WriteResult]:
    """Write one staged bucket to its file in DCP's byte layout and return its results.

    Runs in the background writer (a thread or a process). Every tensor item is the
    ``torch.save`` archive of the tensor, as DCP's ``torch_save`` format stores it, so any
    DCP reader can read the file. Plain CPU tensors are framed directly, without
    ``torch.save`` and with zero CRC-32 fields, as after
    ``torch.serialization.set_crc32_options(False)``
    (:mod:`megatron_async.writer.tensor_archive`); other tensors, and every item when the
    writer has stream transforms (DCP extensions), go through DCP's own item writer.
    With ``compute_checksums`` every byte is hashed on its way to the file (no second
    read). Every result is a :class:`ChecksummedWriteResult` (its ``checksum`` None
    without ``compute_checksums``).

    Args:
        transforms: the writer's ``_StorageWriterTransforms`` (stream extensions).
        bucket: a staged bucket: every tensor must be on the CPU, and no tensor may
            change until this function returns.
        use_fsync: flush the file to stable storage before returning.
        compute_checksums: record an xxh3 digest of every item.
        open_file: opens the file (``open_file(path, "wb")``) when it is not the built-in
            ``open``: how object stores plug in. None or ``open``: direct system calls.
            An opener with an ``open_bucket_file(path, hashing)`` method (our object-store
            opener) gives the bucket file itself: a streamed upload that is abandoned
            (aborted) if closed before ``finish``.

    Raises:
        ValueError: a tensor is not on the CPU (the bucket was not staged).
        OSError: the file could not be written.
    """
    bytes_data, tensor_data = bucket.data
    raw_layout = not getattr(transforms, "extensions", None)
    results: List[WriteResult] = []
    open_bucket_file: Optional[OpenBucketFile] = getattr(open_file, "open_bucket_file", None)
    if open_bucket_file is not None:
        file = open_bucket_file(bucket.file_path, compute_checksums)
    elif open_file is None or open_file is open:
        file = BucketFile(bucket.file_path, compute_checksums)
    else:
        file = OpenedBucketFile(bucket.file_path, compute_checksums, open_file)
    try:

        def write(item: WriteItem, data: Any) -> None:
            file.start_item()
            offset = file.tell()
            if raw_layout and _append_raw_item(file, item, data):
                length = file.tell() - offset
                storage = _StorageInfo(bucket.file_name, offset, length)
                digest = file.finish_item()
                empty = is_empty_chunk(item)
                results.append(ChecksummedWriteResult(item.index, length, storage, digest, empty))
                return
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
            results.append(
                ChecksummedWriteResult(
                    result.index,
                    result.size_in_bytes,
                    result.storage_data,
                    file.finish_item(),
                    is_empty_chunk(item),
                )
            )

        for item, data in bytes_data:
            write(item, data)
        for item, tensor in tensor_data:
            if not tensor.is_cpu:
                raise ValueError(
                    f"{item.index.fqn} is on {tensor.device}; run the request's preload_fn "
                    "(staging) before the save function"
                )
            write(item, tensor)
        file.finish(use_fsync)
    finally:
        file.close()
    return results
