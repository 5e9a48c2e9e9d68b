"""The URL scheme of object storage and the part sizes of uploads to it.

Imports neither torch nor multi-storage-client: anything may import it. Which backend
serves a path is decided in :mod:`megatron_async.storage.backend`."""

from __future__ import annotations

__all__ = ["MSC_URL_PREFIX", "MIN_PART_BYTES", "DEFAULT_PART_BYTES"]

MSC_URL_PREFIX = "msc://"
"""multi-storage-client's URL scheme: ``msc://PROFILE/PREFIX``."""

MIN_PART_BYTES = 5 << 20
"""S3's smallest part of a multipart upload (all parts but the last)."""

DEFAULT_PART_BYTES = 16 << 20
"""Bytes per uploaded part: the memory one file's upload holds at a time."""
