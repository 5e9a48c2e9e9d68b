"""Checkpoints in an object store, reached through multi-storage-client (MSC).

:class:`ObjectStorage` is the :class:`~megatron_async.storage.backend.CheckpointStorage`
of ``msc://PROFILE/PREFIX`` URLs. It runs wherever checkpoints are read or written:
the coordinator (checksums, ``.metadata``, ``metadata.json``, the tracker), every
rank's checks, loaders, the command-line tools and
:class:`~megatron_async.manager.CheckpointManager`; the background writer streams its
buckets through :class:`~.stream.ObjectStoreFileOpener` instead.

One object is one PUT, which the store makes visible whole or not at all: that is
what "atomic" means here, and a completion marker is PUT only after every rank's data
objects were acknowledged. A store has no directories, no rename and no fsync: a
"directory" exists once any object lies under its prefix, and an acknowledged PUT is
durable, so :meth:`~ObjectStorage.sync` and :meth:`~ObjectStorage.sync_dir` do nothing.

An ``msc://`` profile backed by a POSIX directory is served by
:class:`~megatron_async.storage.local.LocalStorage` (atomic rename, fsync), so its
durability is the local one.

Every store failure is raised as :class:`~megatron_async.errors.ObjectStoreError` naming
the URL; a missing object is ``FileNotFoundError`` where the caller expects that.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, TypeVar, Union

from megatron_async.errors import ObjectStoreError
from megatron_async.storage.bounded_calls import call_with_deadline
from megatron_async.storage.client import resolve
from megatron_async.storage.local import LocalStorage, pieces_of

__all__ = ["ObjectStorage"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_LOCAL = LocalStorage()


def _call(what: str, url: str, fn: Callable[[], T]) -> T:
    """One request, bounded and retried (:mod:`megatron_async.storage.bounded_calls`);
    a missing object stays a FileNotFoundError."""
    try:
        return call_with_deadline(what, url, fn)
    except ObjectStoreError as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            raise exc.__cause__ from None
        raise


def _resolved(url: str) -> Tuple[Any, str, Optional[str]]:
    """``(storage client, path in the profile, local path of a POSIX profile or None)``."""
    client, path = resolve(url)
    return client, path, client.get_posix_path(path)


def _prefix(path: str) -> str:
    return path.rstrip("/") + "/"


class ObjectStorage:
    """Checkpoint objects under ``msc://`` URLs (any process; stateless, pickles to the writer)."""

    needs_msc = True

    def __repr__(self) -> str:
        return "ObjectStorage()"

    # -- lookups and reads -------------------------------------------------------------

    def is_file(self, url: str) -> bool:
        client, path, local = _resolved(url)
        if local is not None:
            return _LOCAL.is_file(local)
        return _call("looking up", url, lambda: client.is_file(path))

    def is_dir(self, url: str) -> bool:
        """Whether any object lives under ``url/`` (a store has no empty directories)."""
        client, path, local = _resolved(url)
        if local is not None:
            return _LOCAL.is_dir(local)
        return _call("listing", url, lambda: not client.is_empty(_prefix(path)))

    def size(self, url: str) -> Optional[int]:
        client, path, local = _resolved(url)
        if local is not None:
            return _LOCAL.size(local)
        try:
            return _call("looking up", url, lambda: client.info(path).content_length)
        except FileNotFoundError:
            return None

    def total_bytes(self, url: str) -> int:
        """The bytes of every object under ``url/``, from one listing."""
        client, path, local = _resolved(url)
        if local is not None:
            return _LOCAL.total_bytes(local)
        return _call("listing", url, lambda: sum(meta.content_length for meta in client.list(path=_prefix(path))))

    def list_dir(self, url: str) -> List[Tuple[str, bool]]:
        client, path, local = _resolved(url)
        if local is not None:
            return _LOCAL.list_dir(local)
        prefix = _prefix(path)

        def listing() -> List[Tuple[str, bool]]:
            children = {}
            for meta in client.list(path=prefix, include_directories=True):
                rest = meta.key[len(prefix):] if meta.key.startswith(prefix) else meta.key
                name = rest.strip("/").split("/", 1)[0]
                if name:
                    children[name] = children.get(name, False) or meta.type == "directory" or "/" in rest.strip("/")
            return sorted(children.items())

        return _call("listing", url, listing)

    def read(self, url: str) -> bytes:
        client, path, local = _resolved(url)
        if local is not None:
            return _LOCAL.read(local)
        return _call("reading", url, lambda: client.read(path))

    def read_range(self, url: str, offset: int, length: int) -> bytes:
        client, path, local = _resolved(url)
        if local is not None:
            return _LOCAL.read_range(local, offset, length)
        from multistorageclient.types import Range

        return _call("reading", url, lambda: client.read(path, byte_range=Range(offset, length)))

    def dcp_reader(self, url: str) -> Any:
        from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemReader

        return MultiStorageFileSystemReader(url)

    # -- writes and removals -----------------------------------------------------------

    def write_atomically(self, url: str, data: Union[bytes, str, Sequence[Any]]) -> None:
        """Store ``data`` as the object at ``url``, whole or not at all (one PUT)."""
        pieces = pieces_of(data)
        payload = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        client, path, local = _resolved(url)
        if local is not None:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            _LOCAL.write_atomically(local, payload)
            return
        _call("writing", url, lambda: client.write(path, bytes(payload)))

    def remove(self, url: str) -> bool:
        client, path, local = _resolved(url)
        if local is not None:
            return _LOCAL.remove(local)
        try:
            _call("deleting", url, lambda: client.delete(path))
        except FileNotFoundError:
            return False
        return True

    def make_dir(self, url: str) -> None:
        """Nothing to do: a prefix appears with its first object."""

    def remove_dir(self, url: str, first: Iterable[str] = ()) -> None:
        """Delete ``first`` (the completion markers), then every object under ``url/``.

        A store cannot take a prefix away at once: a deletion that stops halfway
        leaves what ``first`` named deleted, hence an incomplete checkpoint, which no
        resume picks and the next retention deletes.
        """
        for name in first:
            self.remove(os.path.join(url, name))
        self._delete_under(url)

    def _delete_under(self, url: str) -> None:
        client, path, local = _resolved(url)
        if local is not None:
            shutil.rmtree(local, ignore_errors=False)
            return

        def delete_all() -> None:
            keys = [meta.key for meta in client.list(path=_prefix(path))]
            if keys:
                client.delete_many(keys)

        _call("deleting", url, delete_all)

    def finish_removals(self, url: str) -> None:
        """Nothing to do: an interrupted removal left an incomplete checkpoint instead."""

    def sync(self, url: str) -> None:
        """Nothing to do: the store acknowledged the object's PUT durably."""

    def sync_dir(self, url: str) -> None:
        """Nothing to do: a store has no directory entries to flush."""
