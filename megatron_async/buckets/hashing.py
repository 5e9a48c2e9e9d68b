"""The digest every item of a checkpoint gets: xxh3-64, streamed while it is written.

Imports nothing of the package, so the bucket files (:mod:`.bucket_file`, below the
writer and the storage backends) and the checksum records (above them) share it.
"""

from __future__ import annotations

import xxhash

__all__ = ["ALGORITHM", "new_hasher"]

ALGORITHM = "xxh3_64"
"""The name recorded in the checksum file."""


def new_hasher() -> "xxhash.xxh3_64":
    """A fresh streaming hasher of :data:`ALGORITHM` (``update``, ``hexdigest``, ``reset``)."""
    return xxhash.xxh3_64()
