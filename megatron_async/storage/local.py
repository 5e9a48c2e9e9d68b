"""Checkpoints on a local (or network-mounted POSIX) file system.

:class:`LocalStorage` is the :class:`~megatron_async.storage.backend.CheckpointStorage`
of plain paths; any process uses it (the coordinator rank for the small files and the
tracker, every rank for its checks, the background writer for bucket files, loaders and
the command-line tools). It imports no multi-storage-client.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from typing import Any, BinaryIO, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

__all__ = ["LocalStorage", "atomic_output", "fsync_path"]

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]


def fsync_path(path: PathLike, best_effort: bool = False) -> None:
    """Flush a file's content, or a directory's entries (a rename in it), to stable storage.

    Args:
        path: a file or a directory.
        best_effort: log instead of raising where the file system cannot do it (some
            network file systems refuse to open or fsync directories).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if not best_effort:
            raise
        logger.debug("cannot fsync %s: %s", path, exc)


def pieces_of(data: Union[bytes, str, Sequence[Any]]) -> Sequence[Any]:
    """The bytes-like pieces of what ``write_atomically`` takes (``str`` as UTF-8)."""
    if isinstance(data, str):
        return [data.encode()]
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [data]
    return data


@contextlib.contextmanager
def atomic_output(path: PathLike) -> Iterator[BinaryIO]:
    """Open a binary stream whose content replaces ``path`` atomically when the block ends.

    The stream is a uniquely named temporary file beside ``path``. When the block ends
    without an exception, the file is fsynced, renamed over ``path`` and the directory
    fsynced (best effort: some network file systems cannot), so the rename itself is
    durable when the block is left; a crash at any moment leaves the old file or the
    new one, whole. If the block raises, the temporary file is removed and ``path`` is
    untouched.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp_path = os.path.join(
        directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    try:
        with open(tmp_path, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        try:
            os.remove(tmp_path)
        except OSError:
            pass
        raise
    fsync_path(directory, best_effort=True)


def _size_of(entry: os.DirEntry) -> Optional[int]:
    """None for a directory; 0 for what cannot be sized (a dangling link, a file removed
    since the listing): a listing never fails for one entry it does not need."""
    if entry.is_dir():
        return None
    try:
        return entry.stat().st_size
    except OSError:
        return 0


class LocalStorage:
    """Checkpoint files and directories on a POSIX file system (any process).

    Stateless: one instance serves every path. See
    :class:`~megatron_async.storage.backend.CheckpointStorage` for the contract.
    """

    needs_msc = False

    # -- lookups and reads -------------------------------------------------------------

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def list_dir(self, path: str) -> List[Tuple[str, Optional[int]]]:
        if not os.path.isdir(path):
            return []
        with os.scandir(path) as entries:
            return sorted((entry.name, _size_of(entry)) for entry in entries)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def dcp_reader(self, path: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)

    # -- writes and removals -----------------------------------------------------------

    def write_atomically(self, path: str, data: Union[bytes, str, Sequence[Any]]) -> None:
        """Replace ``path`` by ``data``, durably and atomically (see :func:`atomic_output`);
        a sequence of bytes-like pieces is written one after the other, without joining."""
        with atomic_output(path) as stream:
            for piece in pieces_of(data):
                stream.write(piece)

    def remove(self, path: str) -> bool:
        try:
            os.remove(path)
        except FileNotFoundError:
            return False
        return True

    def make_dir(self, path: str) -> None:
        """Create the new directory ``path`` and fsync its parent (best effort)."""
        os.makedirs(path)
        fsync_path(os.path.dirname(os.path.normpath(path)), best_effort=True)

    def remove_dir(self, path: str, first: Iterable[str] = ()) -> None:
        """Delete ``first`` and make that durable, then the whole directory ``path``."""
        for name in first:
            self.remove(os.path.join(path, name))
        fsync_path(path, best_effort=True)
        shutil.rmtree(path)

    def sync(self, path: str) -> None:
        if os.path.exists(path):
            fsync_path(path)

    def sync_dir(self, path: str) -> None:
        fsync_path(path, best_effort=True)
