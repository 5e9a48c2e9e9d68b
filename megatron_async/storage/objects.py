"""Whole objects in an object store: the small files of a checkpoint, listing and deletion.

Runs wherever a checkpoint's small files are read or written: the coordinator
(checksums, ``.metadata``, ``metadata.json``, the tracker), loaders, the command-line
tools and :class:`~megatron_async.manager.CheckpointManager`. One object is one PUT,
which the store makes visible whole or not at all: that is what "atomic" means here,
and a completion marker is PUT only after every rank's data objects were acknowledged.

An ``msc://`` profile backed by a POSIX directory is served by the same local code as a
plain path (atomic rename, fsync), so its durability is the local one.

Every store failure is raised as :class:`~megatron_async.errors.ObjectStoreError` naming
the URL; a missing object is ``FileNotFoundError`` where the caller expects that.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Optional, Tuple, TypeVar

from megatron_async.errors import ObjectStoreError
from megatron_async.storage.client import resolve

__all__ = [
    "read_object",
    "read_object_range",
    "put_object",
    "object_exists",
    "prefix_exists",
    "list_children",
    "delete_object",
    "delete_prefix",
    "posix_path_of",
    "object_size",
    "prefix_bytes",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ADVICE = (
    "check the MSC profile (MSC_CONFIG): its endpoint must be reachable, its credentials "
    "accepted and its bucket must exist"
)


def _call(what: str, url: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except FileNotFoundError:
        raise
    except ObjectStoreError:
        raise
    except Exception as exc:
        raise ObjectStoreError(f"{what} {url} failed: {type(exc).__name__}: {exc}; {_ADVICE}") from exc


def _resolved(url: str) -> Tuple[Any, str, Optional[str]]:
    client, path = resolve(url)
    return client, path, client.get_posix_path(path)


def posix_path_of(url: str) -> Optional[str]:
    """The local path behind ``url`` when its profile is a POSIX directory, else None."""
    return _resolved(url)[2]


def read_object(url: str) -> bytes:
    """Return the whole object at ``url``.

    Raises:
        FileNotFoundError: there is no such object.
        ObjectStoreError: the store failed.
    """
    client, path, local = _resolved(url)
    if local is not None:
        with open(local, "rb") as f:
            return f.read()
    return _call("reading", url, lambda: client.read(path))


def read_object_range(url: str, offset: int, length: int) -> bytes:
    """Return ``length`` bytes of the object at ``url`` from ``offset`` (fewer at its end)."""
    client, path, local = _resolved(url)
    if local is not None:
        with open(local, "rb") as f:
            f.seek(offset)
            return f.read(length)
    from multistorageclient.types import Range

    return _call("reading", url, lambda: client.read(path, byte_range=Range(offset, length)))


def put_object(url: str, data: bytes) -> None:
    """Store ``data`` as the object at ``url``, whole or not at all (one PUT)."""
    client, path, local = _resolved(url)
    if local is not None:
        from megatron_async.format import write_atomically

        os.makedirs(os.path.dirname(local), exist_ok=True)
        write_atomically(local, data)
        return
    _call("writing", url, lambda: client.write(path, bytes(data)))


def object_exists(url: str) -> bool:
    """Whether an object (a file) exists at ``url``."""
    client, path, local = _resolved(url)
    if local is not None:
        return os.path.isfile(local)
    return _call("looking up", url, lambda: client.is_file(path))


def prefix_exists(url: str) -> bool:
    """Whether any object lives under ``url/`` (an object store has no empty directories)."""
    client, path, local = _resolved(url)
    if local is not None:
        return os.path.isdir(local)
    return _call("listing", url, lambda: not client.is_empty(path.rstrip("/") + "/"))


def list_children(url: str) -> List[Tuple[str, bool]]:
    """Return ``(name, is_directory)`` of what lies directly under ``url``, sorted by name."""
    client, path, local = _resolved(url)
    if local is not None:
        if not os.path.isdir(local):
            return []
        return sorted((n, os.path.isdir(os.path.join(local, n))) for n in os.listdir(local))
    prefix = path.rstrip("/") + "/"

    def listing() -> List[Tuple[str, bool]]:
        children = {}
        for meta in client.list(path=prefix, include_directories=True):
            rest = meta.key[len(prefix):] if meta.key.startswith(prefix) else meta.key
            name = rest.strip("/").split("/", 1)[0]
            if name:
                children[name] = children.get(name, False) or meta.type == "directory" or "/" in rest.strip("/")
        return sorted(children.items())

    return _call("listing", url, listing)


def delete_object(url: str) -> bool:
    """Delete the object at ``url``; return whether there was one."""
    client, path, local = _resolved(url)
    if local is not None:
        try:
            os.remove(local)
        except FileNotFoundError:
            return False
        return True
    try:
        _call("deleting", url, lambda: client.delete(path))
    except FileNotFoundError:
        return False
    return True


def delete_prefix(url: str) -> None:
    """Delete every object under ``url/`` (a checkpoint "directory")."""
    client, path, local = _resolved(url)
    if local is not None:
        import shutil

        shutil.rmtree(local, ignore_errors=False)
        return
    prefix = path.rstrip("/") + "/"

    def delete_all() -> None:
        keys = [meta.key for meta in client.list(path=prefix)]
        if keys:
            client.delete_many(keys)

    _call("deleting", url, delete_all)


def object_size(url: str) -> Optional[int]:
    """The size of the object at ``url`` in bytes, or None when there is none."""
    client, path, local = _resolved(url)
    if local is not None:
        return os.path.getsize(local) if os.path.isfile(local) else None
    try:
        return _call("looking up", url, lambda: client.info(path).content_length)
    except FileNotFoundError:
        return None


def prefix_bytes(url: str) -> int:
    """The bytes of every object under ``url/`` (a checkpoint's size), from one listing."""
    client, path, local = _resolved(url)
    if local is not None:
        return sum(
            os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(local)
            for name in names
        )
    prefix = path.rstrip("/") + "/"
    return _call("listing", url, lambda: sum(meta.content_length for meta in client.list(path=prefix)))
