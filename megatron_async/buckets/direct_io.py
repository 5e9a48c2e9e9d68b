"""Local bucket files, written with ``O_DIRECT``: bytes go to the disk without the page cache.

Runs in the background writer (and in the trainer for synchronous saves). The page
cache's writeback would cost several times the CPU of the direct write, CPU taken from
the training (see "Direct I/O, not the page cache" in docs/design.md).

Direct I/O wants the memory, the file offset and the length aligned to the device's
block size, while DCP's byte layout puts items at arbitrary offsets. So pieces are
copied into an aligned *bounce chunk* (one memory copy, far cheaper than the page
cache's copy plus writeback), and every full chunk is one ``write``. The last partial
chunk is written padded to the alignment and the file is then cut to its true size.

A file system that refuses direct I/O at open (``EINVAL``) gets the file opened
buffered; one that refuses it at the first write has the flag cleared on the open file.
Either way the same chunks are then written through the page cache, each dropped from
it with ``posix_fadvise`` once written (which also starts its writeback).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import threading
from typing import List, Optional

from megatron_async.buckets import bucket_file
from megatron_async.buckets.bucket_file import BucketFile

__all__ = ["ChunkPool", "DIRECT_IO_ALIGNMENT", "LocalBucketFile"]

logger = logging.getLogger(__name__)

DIRECT_IO_ALIGNMENT = 4096
"""Alignment of direct writes: the logical block size of every common device or below it."""


def _new_chunk() -> mmap.mmap:
    """A page-aligned bounce chunk in private memory: a process forked while it exists
    gets a copy of its own, so no two processes ever fill one chunk."""
    return mmap.mmap(-1, bucket_file.CHUNK_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class ChunkPool:
    """Spare bounce chunks of one process (any of its threads). A fresh chunk's first fill
    costs about 4 ms of page faults and zeroing per 8 MiB, for every file of every save
    without a pool. Its owner gives a forked process a pool of its own."""

    def __init__(self, keep: int = 8) -> None:
        self._lock = threading.Lock()
        self._free: List[mmap.mmap] = []
        self._keep = keep

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return _new_chunk()

    def give_back(self, chunk: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(chunk)
                return
        with contextlib.suppress(BufferError):  # a view in a live traceback: unmapped with it
            chunk.close()


class LocalBucketFile(BucketFile):
    """One bucket's local file, written from an aligned bounce chunk with ``O_DIRECT``
    when ``direct_io`` is asked for and the file system accepts it, else buffered. The
    chunk comes from ``chunks`` and goes back there at close (without a pool: the file's
    own, unmapped at close)."""

    def __init__(self, path: str, hashing: bool, direct_io: bool = True,
                 chunks: Optional[ChunkPool] = None):
        self._chunks = chunks
        self._chunk = chunks.take() if chunks is not None else _new_chunk()
        super().__init__(self._chunk, hashing)
        self._direct = direct_io
        self._advise = True
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | (os.O_DIRECT if self._direct else 0), 0o666)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self._direct:
                raise
            logger.debug("%s: the file system refuses direct I/O; writing buffered", path)
            self._direct = False
            self._fd = os.open(path, flags, 0o666)

    @property
    def writes_direct(self) -> bool:
        """Whether writes bypass the page cache (False when the file system refused)."""
        return self._direct

    def finish(self, use_fsync: bool) -> None:
        """Write the last partial chunk (padded, then cut off) and, with ``use_fsync``,
        make the file, its size included, durable."""
        size = self._written + self._filled
        if self._filled and self._direct:
            length = -(-self._filled // DIRECT_IO_ALIGNMENT) * DIRECT_IO_ALIGNMENT
            self._view[self._filled:length] = bytes(length - self._filled)
            self._filled = length
        super().finish(use_fsync)
        if self._written != size:
            os.ftruncate(self._fd, size)
            self._written = size
        if use_fsync:
            self.fsync()

    def fsync(self) -> None:
        """Make what :meth:`finish` wrote, the file's size included, durable."""
        os.fsync(self._fd)

    def close(self) -> None:
        try:
            os.close(self._fd)
        finally:
            self._view.release()
            if self._chunks is not None:
                self._chunks.give_back(self._chunk)
            else:
                with contextlib.suppress(BufferError):  # a view in a live traceback: unmapped with it
                    self._chunk.close()

    def _write_chunk(self, length: int) -> None:
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
        if not self._direct and self._advise:
            try:
                os.posix_fadvise(self._fd, self._written - length, length, os.POSIX_FADV_DONTNEED)
            except OSError as exc:  # not a regular file, or no such hint here: only slower
                logger.debug("posix_fadvise is not available for this file: %s", exc)
                self._advise = False

    def _stop_direct_io(self, cause: Optional[OSError]) -> None:
        """Go on writing this file buffered (the file system refused a direct write)."""
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self._direct = False
        logger.debug("direct I/O refused after %d bytes (%s); writing buffered", self._written, cause)
