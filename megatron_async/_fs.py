"""Durability helper for files the library writes (any side: trainer, coordinator, worker)."""

from __future__ import annotations

import logging
import os
from typing import Union

__all__ = ["fsync_path"]

logger = logging.getLogger(__name__)


def fsync_path(path: Union[str, "os.PathLike[str]"], best_effort: bool = False) -> None:
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
