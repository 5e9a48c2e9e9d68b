"""A bucket's output file: few large system calls, every item hashed on its way.

Runs in the background writer (and in the trainer for synchronous saves).
:class:`BucketFile` writes buffered, through the page cache; :class:`OpenedBucketFile`
goes through a caller-given ``open_file`` (object stores, custom I/O). Local files are
normally written with direct I/O instead (:mod:`megatron_async.buckets.direct_io`), which
keeps this interface.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any, Callable, List, Optional

from megatron_async.buckets.hashing import new_hasher

__all__ = ["BucketFile", "OpenedBucketFile"]

logger = logging.getLogger(__name__)


_GATHER_BYTES = 8 << 20
"""Pieces are gathered until this many bytes are pending, then written with one ``writev``."""

_GATHER_PIECES = 512
"""At most this many pieces per ``writev`` (the system's limit, IOV_MAX, is usually 1024)."""

_WRITEBACK_BYTES = 16 << 20
"""After every this many written bytes, the kernel is asked to start writing them back."""


class BucketFile:
    """One bucket's file, written with few large system calls, every item hashed on its way.

    Items are appended one after the other, between :meth:`start_item` and
    :meth:`finish_item` (which returns the item's digest).

    * :meth:`append` keeps a reference to the caller's memory instead of copying it (the
      tensors of a staged bucket and the cached archive frames stay valid until the file
      is finished), and pending pieces go out in one ``writev``: no byte is copied in
      user space.
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
        self._hasher = new_hasher() if hashing else None
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

    def release_pieces(self) -> None:
        """Write what is pending, so the memory appended so far may change from now on
        (staging in rounds reuses it for the next items)."""
        self._write_pending()

    # -- the stream DCP's item writer sees ---------------------------------------------

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        """The file offset after everything appended so far."""
        return self._written + self._pending_bytes

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self.append(self._kept(view))
        except OSError as exc:
            if self.write_error is None:
                self.write_error = exc
            raise
        return view.nbytes

    def _kept(self, view: memoryview) -> Any:
        """What :meth:`append` may keep of a piece ``torch.save`` will reuse: a copy, unless
        the piece is large enough to be written out before :meth:`write` returns."""
        return view if view.nbytes >= _GATHER_BYTES else view.tobytes()

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

    The same gathering and hashing as :class:`BucketFile`, but every system call goes
    through the stream ``open_file(path, "wb")`` returned: pieces are written with its
    ``write``, ``fsync`` applies only when the stream has a real file descriptor, and no
    page-cache hints are given.
    """

    def __init__(self, path: str, hashing: bool, open_file: Callable[..., Any]):
        self._stream = open_file(path, "wb")
        self._start_stream(hashing)
        self._advise = False

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
