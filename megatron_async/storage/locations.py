"""The URL scheme of object storage and the part sizes of uploads to it.

Imports neither torch nor multi-storage-client: anything may import it. Which backend
serves a path is decided in :mod:`megatron_async.storage.backend`, the one place that
asks :func:`is_object_url`."""

from __future__ import annotations

import os
from typing import Union

__all__ = ["MSC_URL_PREFIX", "MIN_PART_BYTES", "DEFAULT_PART_BYTES", "is_object_url", "normalize_checkpoint_path"]

PathLike = Union[str, "os.PathLike[str]"]

MSC_URL_PREFIX = "msc://"
"""multi-storage-client's URL scheme: ``msc://PROFILE/PREFIX``."""

MIN_PART_BYTES = 5 << 20
"""S3's smallest part of a multipart upload (all parts but the last)."""

DEFAULT_PART_BYTES = 16 << 20
"""Bytes per uploaded part: the memory one file's upload holds at a time."""


def is_object_url(path: PathLike) -> bool:
    """Whether ``path`` is an ``msc://`` URL (a ``pathlib.Path`` of one reads ``msc:/...``)."""
    text = os.fspath(path)
    return isinstance(text, str) and text.startswith("msc:/")


def normalize_checkpoint_path(path: PathLike) -> str:
    """Return the one spelling of a checkpoint path that every rank and process uses.

    A local path becomes absolute; an ``msc://`` URL keeps its profile and prefix, without
    a trailing slash (``Path("msc://p/x")`` prints ``msc:/p/x``: both name one place).
    """
    text = os.fspath(path)
    if not is_object_url(text):
        return os.path.abspath(text)
    rest = text[len("msc:/"):].lstrip("/")
    return MSC_URL_PREFIX + rest.rstrip("/")
