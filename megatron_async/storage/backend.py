"""One storage interface for checkpoints, chosen once from the path.

Everything that lists, reads, writes or removes checkpoint files asks
:func:`storage_for` once for the :class:`CheckpointStorage` that serves a path (local
files, or objects under an ``msc://`` URL), and then calls its methods; no other code
asks whether a path is a URL.

Any process may call this module (the trainer's ranks, the coordinator, the background
writer, loaders and the command-line tools); it imports no multi-storage-client.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, List, Optional, Protocol, Sequence, Tuple, Union

from megatron_async.storage.local import LocalStorage
from megatron_async.storage.client import is_object_url, normalize_checkpoint_path

__all__ = ["CheckpointStorage", "is_object_url", "normalize_checkpoint_path", "storage_for"]

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointStorage(Protocol):
    """The operations the package needs from where checkpoints live.

    Every path is a full path (or URL) as :func:`storage_for` was given it, joined with
    ``os.path.join``. Implementations are small, stateless apart from options, and
    picklable, so one can be handed to the background writer.
    """

    needs_msc: bool
    """Whether this storage is reached through multi-storage-client (``use_msc=True``)."""

    def is_file(self, path: str) -> bool:
        """Whether a file (an object) exists at ``path``."""

    def is_dir(self, path: str) -> bool:
        """Whether the directory ``path`` exists (in a store: any object under ``path/``)."""

    def list_dir(self, path: str) -> List[Tuple[str, Optional[int]]]:
        """``(name, num_bytes)`` of what lies directly under ``path``, sorted by name, from
        one listing; ``num_bytes`` is None for a directory. Empty when ``path`` does not
        exist."""

    def read(self, path: str) -> bytes:
        """The whole file at ``path``; ``FileNotFoundError`` when there is none."""

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the file at ``path`` from ``offset`` (fewer at its end)."""

    def dcp_reader(self, path: str) -> Any:
        """A ``torch.distributed.checkpoint`` ``StorageReader`` of the checkpoint at ``path``."""

    def write_atomically(self, path: str, data: Union[bytes, str, Sequence[Any]]) -> None:
        """Replace the file at ``path`` by ``data`` (``str`` as UTF-8; or bytes-like pieces,
        written in order), atomically and durably: after a crash it is the old content or
        the new one, whole."""

    def remove(self, path: str) -> bool:
        """Remove the file at ``path``; return whether there was one."""

    def make_dir(self, path: str) -> None:
        """Create the new, empty directory ``path`` durably (a store needs nothing)."""

    def remove_dir(self, path: str, first: Iterable[str] = ()) -> None:
        """Delete the directory ``path`` and everything in it.

        Args:
            first: names under ``path`` that must be gone before anything else is
                deleted, so that a removal stopped halfway leaves an incomplete
                checkpoint, which no resume picks and the next retention deletes.

        Raises:
            OSError: the removal failed (``ObjectStoreError`` in a store).
        """

    def sync(self, path: str) -> None:
        """Make the file at ``path``, written without a flush, durable; skip a missing one."""

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` (creates, renames) durable, best effort."""


_LOCAL = LocalStorage()


def storage_for(path: PathLike) -> CheckpointStorage:
    """Return the storage that serves ``path``: object storage for ``msc://`` URLs, else local.

    Choosing needs neither multi-storage-client nor any I/O; a missing
    multi-storage-client is reported by the first operation on an object URL
    (:class:`~megatron_async.errors.ObjectStoreUnavailableError`).
    """
    if is_object_url(path):
        from megatron_async.storage.objects import ObjectStorage

        return ObjectStorage()
    return _LOCAL
