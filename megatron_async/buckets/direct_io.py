"""Bucket files written with ``O_DIRECT``: bytes go to the disk without the page cache.

Runs in the background writer (and in the trainer for synchronous saves). The page
cache's writeback would cost several times the CPU of the direct write, CPU taken from
the training (see "Direct I/O, not the page cache" in docs/design.md).

Direct I/O wants the memory, the file offset and the length aligned to the device's
block size, while DCP's byte layout puts items at arbitrary offsets. So pieces are
copied into an aligned *bounce chunk* (one memory copy, far cheaper than the page
cache's copy plus writeback), and every full chunk is one ``write``. The last partial
chunk is written padded to the alignment and the file is then cut to its true size.

A file system that refuses direct I/O at open (``EINVAL``) gets the buffered
:class:`~megatron_async.buckets.bucket_file.BucketFile`; one that refuses it at the first
write has the flag cleared on the open file, and the same chunks are written buffered.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from typing import Any, List, Optional

from megatron_async.buckets.bucket_file import BucketFile

__all__ = ["DIRECT_IO_ALIGNMENT", "DirectBucketFile", "open_local_bucket_file"]

logger = logging.getLogger(__name__)

DIRECT_IO_ALIGNMENT = 4096
"""Alignment of direct writes: the logical block size of every common device or below it."""

_CHUNK_BYTES = 8 << 20
"""Bytes per direct ``write``: large enough that the per-request cost vanishes."""

_HASH_BLOCK_BYTES = 1 << 20
"""Bytes copied into the chunk, then hashed, at a time: small enough to stay in cache."""

_KEEP_CHUNKS = 4
"""Bounce chunks kept for reuse (the writer's threads each hold one while writing)."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)


_free_chunks: List[mmap.mmap] = []
"""Page-aligned private anonymous mappings of :data:`_CHUNK_BYTES`, reused from file to
file so that a save does not fault in fresh memory for its bounce chunks (``list.pop``
and ``append`` are atomic: the writer's threads share it without a lock). Private, so a
forked writer's copy of an inherited chunk is its own (copy-on-write): a shared mapping
would let two writers fill one chunk at once."""


def _take_chunk() -> mmap.mmap:
    try:
        return _free_chunks.pop()
    except IndexError:
        return mmap.mmap(-1, _CHUNK_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _give_back_chunk(chunk: mmap.mmap) -> None:
    if len(_free_chunks) < _KEEP_CHUNKS:
        _free_chunks.append(chunk)
    else:
        chunk.close()


class DirectBucketFile(BucketFile):
    """One bucket's file written with ``O_DIRECT`` through an aligned bounce chunk.

    The same item interface as :class:`BucketFile` (a stream for ``torch.save`` too);
    pieces are copied into the chunk as they are appended (so, unlike
    :class:`BucketFile`, they need not stay unchanged), and hashed from the chunk, block
    by block, while each block is still in cache.
    """

    def __init__(self, fd: int, hashing: bool):
        self._fd = fd
        self._start_stream(hashing)
        self._direct = True
        self._chunk: Optional[mmap.mmap] = _take_chunk()
        self._view = memoryview(self._chunk)
        self._filled = 0

    @property
    def writes_direct(self) -> bool:
        """Whether writes still bypass the page cache (False once the file system refused)."""
        return self._direct

    def append(self, *pieces: Any) -> None:
        hasher = self._hasher
        for piece in pieces:
            view = memoryview(piece).cast("B")
            size = view.nbytes
            done = 0
            while done < size:
                take = min(size - done, _CHUNK_BYTES - self._filled, _HASH_BLOCK_BYTES)
                start = self._filled
                self._view[start:start + take] = view[done:done + take]
                if hasher is not None:
                    # Hashed while the block is in cache: no second read of the source.
                    hasher.update(self._view[start:start + take])
                self._filled += take
                done += take
                if self._filled == _CHUNK_BYTES:
                    self._write_chunk(_CHUNK_BYTES)
                    self._filled = 0

    def tell(self) -> int:
        return self._written + self._filled

    def _kept(self, view: memoryview) -> Any:
        return view  # copied into the chunk as it is appended

    def finish(self, use_fsync: bool) -> None:
        """Write the last partial chunk (padded, then cut off) and, with ``use_fsync``,
        make the file, its size included, durable."""
        size = self._written + self._filled
        if self._filled:
            length = self._filled
            if self._direct:
                length = -(-self._filled // DIRECT_IO_ALIGNMENT) * DIRECT_IO_ALIGNMENT
                self._view[self._filled:length] = bytes(length - self._filled)
            self._write_chunk(length)
            self._filled = 0
            if self._written != size:
                os.ftruncate(self._fd, size)
                self._written = size
        if use_fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        try:
            os.close(self._fd)
        finally:
            if self._chunk is not None:
                self._view.release()
                _give_back_chunk(self._chunk)
                self._chunk = None

    def _write_chunk(self, length: int) -> None:
        """Write the chunk's first ``length`` bytes at the end of the file."""
        done = 0
        while done < length:
            try:
                count = os.write(self._fd, self._view[done:length])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self._direct:
                    raise
                self._stop_direct_io(exc)
                continue
            if count == 0:
                raise OSError(errno.EIO, f"the file accepted no bytes at offset {self._written}")
            done += count
            self._written += count
            if self._direct and done < length and done % DIRECT_IO_ALIGNMENT:
                self._stop_direct_io(None)  # a short write left the rest unaligned

    def _stop_direct_io(self, cause: Optional[OSError]) -> None:
        """Go on writing this file buffered (the file system refused a direct write)."""
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self._direct = False
        logger.debug("direct I/O refused after %d bytes (%s); writing buffered", self._written, cause)


def open_local_bucket_file(path: str, hashing: bool, direct_io: bool) -> BucketFile:
    """Open a bucket's local file: direct I/O when asked for and accepted, else buffered."""
    if direct_io and _O_DIRECT:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            logger.debug("%s: the file system refuses direct I/O; writing buffered", path)
        else:
            try:
                return DirectBucketFile(fd, hashing)
            except BaseException:
                os.close(fd)
                raise
    return BucketFile(path, hashing)
