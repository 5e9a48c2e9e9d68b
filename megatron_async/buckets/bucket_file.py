"""A bucket's output: bytes gathered in a chunk, every item hashed on its way.

Runs in the background writer (and in the trainer for synchronous saves).
:class:`BucketFile` copies what is appended into a chunk and hands each full chunk to
its output: a local file (:class:`~megatron_async.buckets.direct_io.LocalBucketFile`,
``O_DIRECT`` where accepted), a caller-given ``open_file`` (:class:`OpenedBucketFile`),
or an object store's multipart upload (:mod:`megatron_async.storage.stream`).

The digest every item gets is xxh3-64 (:func:`new_hasher`), which the checksum records of
:mod:`megatron_async.integrity.checksums` name and re-check.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Callable, Optional

import xxhash

__all__ = ["ALGORITHM", "BucketFile", "CHUNK_BYTES", "OpenedBucketFile", "new_hasher"]

ALGORITHM = "xxh3_64"
"""The name recorded in the checksum file."""

CHUNK_BYTES = 8 << 20
"""Bytes per written chunk: large enough that the per-write cost vanishes."""

_HASH_BLOCK_BYTES = 1 << 20
"""Bytes copied into the chunk, then hashed, at a time: small enough to stay in cache."""


def new_hasher() -> "xxhash.xxh3_64":
    """A fresh streaming hasher of :data:`ALGORITHM` (``update``, ``hexdigest``, ``reset``)."""
    return xxhash.xxh3_64()


class BucketFile:
    """One bucket's output, written a chunk at a time, every item hashed on its way.

    Items are appended one after the other, between :meth:`start_item` and
    :meth:`finish_item` (which returns the item's digest). :meth:`append` copies each
    piece into the chunk block by block and hashes the block there, while it is in cache
    (no second read of the source); the caller's memory may change as soon as it returns
    (staging in rounds reuses it for the next items). :meth:`write`, :meth:`tell` and
    :meth:`flush` make the object a stream for DCP's item writer (``torch.save``).
    Subclasses give the output: :meth:`_write_chunk`, :meth:`finish` and :meth:`close`.

    Args:
        chunk: the writable buffer the bytes are gathered in.
        hashing: compute a digest per item.

    Attributes:
        write_error: the first ``OSError`` raised while ``torch.save`` was writing.
            ``torch.save`` swallows the exceptions of a stream's ``write`` and reports
            only "unexpected pos"; the writer re-raises this one, so a full disk reads as
            ENOSPC.
    """

    def __init__(self, chunk: Any, hashing: bool):
        self._view = memoryview(chunk)
        self._hasher = new_hasher() if hashing else None
        self._filled = 0
        self._written = 0
        self.write_error: Optional[OSError] = None

    # -- items -------------------------------------------------------------------------

    def start_item(self) -> None:
        if self._hasher is not None:
            self._hasher.reset()

    def finish_item(self) -> Optional[str]:
        return self._hasher.hexdigest() if self._hasher is not None else None

    def append(self, *pieces: Any) -> None:
        """Append ``pieces`` (bytes-like), copied before this returns."""
        chunk_bytes = self._view.nbytes
        for piece in pieces:
            view = memoryview(piece).cast("B")
            done = 0
            while done < view.nbytes:
                take = min(view.nbytes - done, chunk_bytes - self._filled, _HASH_BLOCK_BYTES)
                start = self._filled
                self._view[start:start + take] = view[done:done + take]
                if self._hasher is not None:
                    self._hasher.update(self._view[start:start + take])
                self._filled += take
                done += take
                if self._filled == chunk_bytes:
                    self._write_chunk(chunk_bytes)
                    self._filled = 0

    def free_space(self) -> memoryview:
        """The chunk's unfilled tail (never empty), for a source that reads into memory
        itself (``socket.recv_into``): fill its start, then :meth:`commit` the bytes
        filled. The bytes go into the chunk without passing through another buffer."""
        return self._view[self._filled:]

    def commit(self, count: int) -> None:
        """Append the first ``count`` bytes of :meth:`free_space`, just filled: hash them
        while they are in cache, and write the chunk once full."""
        start = self._filled
        if self._hasher is not None:
            self._hasher.update(self._view[start:start + count])
        self._filled += count
        if self._filled == self._view.nbytes:
            self._write_chunk(self._filled)
            self._filled = 0

    def finish(self, use_fsync: bool) -> None:
        """Write what the chunk still holds (subclasses then make the output durable)."""
        if self._filled:
            self._write_chunk(self._filled)
            self._filled = 0

    def close(self) -> None:
        raise NotImplementedError

    def _write_chunk(self, length: int) -> None:
        """Write the chunk's first ``length`` bytes after the output's end, adding them
        to ``_written``."""
        raise NotImplementedError

    # -- the stream DCP's item writer sees ---------------------------------------------

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        """The output offset after everything appended so far."""
        return self._written + self._filled

    def write(self, data: Any) -> int:
        try:
            self.append(data)
        except OSError as exc:
            if self.write_error is None:
                self.write_error = exc
            raise
        return memoryview(data).nbytes

    def flush(self) -> None:
        """Do nothing: DCP flushes after every item, and a system call per item is what
        this class avoids. :meth:`finish` writes everything out."""


class OpenedBucketFile(BucketFile):
    """A bucket's file opened by a caller-given ``open_file`` (custom I/O).

    Every chunk goes to the stream ``open_file(path, "wb")`` returned; ``fsync`` applies
    only when the stream has a real file descriptor. The chunk is refilled as soon as
    ``write`` returns (Python's I/O contract): a stream must not keep the view it is given.
    """

    def __init__(self, path: str, hashing: bool, open_file: Callable[..., Any]):
        super().__init__(bytearray(CHUNK_BYTES), hashing)
        self._stream = open_file(path, "wb")

    def _write_chunk(self, length: int) -> None:
        done = 0
        while done < length:
            count = self._stream.write(self._view[done:length])
            if count == 0:
                raise OSError(errno.EIO, f"the file accepted no bytes at offset {self._written + done}")
            done = length if count is None else done + count
        self._written += length

    def finish(self, use_fsync: bool) -> None:
        super().finish(use_fsync)
        self._stream.flush()
        if use_fsync:
            try:
                fd = self._stream.fileno()
            except (AttributeError, OSError, ValueError):  # no descriptor: durable on close
                return
            os.fsync(fd)

    def close(self) -> None:
        self._stream.close()
