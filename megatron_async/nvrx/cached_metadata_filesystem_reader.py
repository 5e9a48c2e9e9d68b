"""``nvidia_resiliency_ext.checkpointing.async_ckpt.cached_metadata_filesystem_reader``.

A DCP ``FileSystemReader`` that reads a checkpoint's ``.metadata`` once per process.

Loads that assume a constant checkpoint structure (Megatron-LM's
``--ckpt-assume-constant-structure``) read the same ``.metadata`` again and again;
megatron-core and nvidia-resiliency-ext name this reader ``CachedMetadataFileSystemReader``
and we keep the name and both constructors (``(path)`` and ``(path, cache_metadata=...)``).

Unlike a cache keyed by path alone, an entry is used only while the ``.metadata`` file
is the same file (same size and modification time): a checkpoint rewritten in place is
read afresh, never served stale metadata. Runs wherever a load runs (every rank).
"""

from __future__ import annotations

import os
import threading
from typing import Dict, Optional, Tuple, Union

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from megatron_async.format import DCP_METADATA_FILE

__all__ = ["CachedMetadataFileSystemReader"]

_FileIdentity = Tuple[int, int, int]


def _metadata_identity(checkpoint_dir: str) -> Optional[_FileIdentity]:
    """``(inode, size, mtime_ns)`` of the checkpoint's ``.metadata``, or None if absent."""
    try:
        info = os.stat(os.path.join(checkpoint_dir, DCP_METADATA_FILE))
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


class CachedMetadataFileSystemReader(FileSystemReader):
    """Read DCP checkpoints from a directory, caching ``.metadata`` per directory.

    Args:
        cache_metadata: keep the parsed metadata in a process-wide cache shared by all
            readers of the same directory; False reads it every time.
    """

    _metadata_cache: Dict[str, Tuple[_FileIdentity, Metadata]] = {}
    _cache_lock = threading.Lock()

    def __init__(self, path: Union[str, os.PathLike], cache_metadata: bool = True) -> None:
        super().__init__(path)
        self._cache_key = os.path.abspath(os.fspath(path)) if cache_metadata else None

    def read_metadata(self) -> Metadata:
        """Return the checkpoint's metadata, from the cache while the file is unchanged."""
        if self._cache_key is None:
            return super().read_metadata()
        identity = _metadata_identity(self._cache_key)
        with self._cache_lock:
            entry = self._metadata_cache.get(self._cache_key)
        if entry is not None and identity is not None and entry[0] == identity:
            return entry[1]
        metadata = super().read_metadata()
        if identity is not None and identity == _metadata_identity(self._cache_key):
            with self._cache_lock:
                self._metadata_cache[self._cache_key] = (identity, metadata)
        return metadata

    @classmethod
    def clear_metadata_cache(cls) -> None:
        """Forget the cached metadata of every directory (megatron-core's classmethod)."""
        with cls._cache_lock:
            cls._metadata_cache.clear()
