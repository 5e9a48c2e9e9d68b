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
:class:`~megatron_async.storage.local.LocalStorage` (atomic rename, fsync) on the
profile's directory, so its durability is the local one.

Every store failure is raised as :class:`~megatron_async.errors.ObjectStoreError` naming
the URL; a missing object is ``FileNotFoundError`` where the caller expects that.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from megatron_async.storage.bounded_calls import call_with_deadline
from megatron_async.storage.client import resolve
from megatron_async.storage.local import LocalStorage, pieces_of

__all__ = ["ObjectStorage"]

_LOCAL = LocalStorage()


def _local_for_posix_profiles(method):
    """Serve a URL of a POSIX profile by LocalStorage's method of the same name on the
    profile's directory; any other as ``method(self, client, path_in_profile, url, ...)``."""

    @functools.wraps(method)
    def serve(self, url: str, *args: Any, **kwargs: Any) -> Any:
        client, path = resolve(url)
        local = client.get_posix_path(path)
        if local is not None:
            return getattr(_LOCAL, method.__name__)(local, *args, **kwargs)
        return method(self, client, path, url, *args, **kwargs)

    return serve


def _prefix(path: str) -> str:
    return path.rstrip("/") + "/"


class ObjectStorage:
    """Checkpoint objects under ``msc://`` URLs (any process; stateless, pickles to the writer).

    Each request is bounded (:func:`~megatron_async.storage.bounded_calls.call_with_deadline`).
    """

    needs_msc = True

    # -- lookups and reads -------------------------------------------------------------

    @_local_for_posix_profiles
    def is_file(self, client: Any, path: str, url: str) -> bool:
        return call_with_deadline("looking up", url, lambda: client.is_file(path))

    @_local_for_posix_profiles
    def is_dir(self, client: Any, path: str, url: str) -> bool:
        """Whether any object lives under ``url/`` (a store has no empty directories)."""
        return call_with_deadline("listing", url, lambda: not client.is_empty(_prefix(path)))

    @_local_for_posix_profiles
    def list_dir(self, client: Any, path: str, url: str) -> List[Tuple[str, Optional[int]]]:
        """What lies under ``url/``: objects with their sizes, and the names of deeper
        prefixes (directories)."""
        prefix = _prefix(path)

        def listing() -> List[Tuple[str, Optional[int]]]:
            children: Dict[str, Optional[int]] = {}
            for meta in client.list(path=prefix, include_directories=True):
                rest = (meta.key[len(prefix):] if meta.key.startswith(prefix) else meta.key).strip("/")
                name = rest.split("/", 1)[0]
                is_dir = meta.type == "directory" or "/" in rest or children.get(name, 0) is None
                if name:
                    children[name] = None if is_dir else meta.content_length
            return sorted(children.items())

        return call_with_deadline("listing", url, listing)

    @_local_for_posix_profiles
    def read(self, client: Any, path: str, url: str) -> bytes:
        return call_with_deadline("reading", url, lambda: client.read(path))

    @_local_for_posix_profiles
    def read_range(self, client: Any, path: str, url: str, offset: int, length: int) -> bytes:
        from multistorageclient.types import Range

        return call_with_deadline("reading", url, lambda: client.read(path, byte_range=Range(offset, length)))

    def dcp_reader(self, url: str) -> Any:
        from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemReader

        return MultiStorageFileSystemReader(url)

    # -- writes and removals -----------------------------------------------------------

    def write_atomically(self, url: str, data: Union[bytes, str, Sequence[Any]]) -> None:
        """Store ``data`` as the object at ``url``, whole or not at all (one PUT)."""
        pieces = pieces_of(data)
        payload = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        client, path = resolve(url)
        local = client.get_posix_path(path)
        if local is not None:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            _LOCAL.write_atomically(local, payload)
            return
        call_with_deadline("writing", url, lambda: client.write(path, bytes(payload)))

    @_local_for_posix_profiles
    def remove(self, client: Any, path: str, url: str) -> bool:
        try:
            call_with_deadline("deleting", url, lambda: client.delete(path))
        except FileNotFoundError:
            return False
        return True

    @_local_for_posix_profiles
    def make_dir(self, client: Any, path: str, url: str) -> None:
        """Nothing to do: a prefix appears with its first object."""

    @_local_for_posix_profiles
    def remove_dir(self, client: Any, path: str, url: str, first: Iterable[str] = ()) -> None:
        """Delete ``first`` (the completion markers), then every object under ``url/``."""
        for name in first:
            self.remove(os.path.join(url, name))

        def delete_all() -> None:
            keys = [meta.key for meta in client.list(path=_prefix(path))]
            if keys:
                client.delete_many(keys)

        call_with_deadline("deleting", url, delete_all)

    @_local_for_posix_profiles
    def sync(self, client: Any, path: str, url: str) -> None:
        """Nothing to do: the store acknowledged the object's PUT durably."""

    @_local_for_posix_profiles
    def sync_dir(self, client: Any, path: str, url: str) -> None:
        """Nothing to do: a store has no directory entries to flush."""
