"""The on-disk format in one place: file names and the completeness rule.

Everything that names a file of a checkpoint or decides whether a checkpoint is
complete goes through this module, on any side (trainer, coordinator rank, background
writer). It imports neither torch, megatron-core nor a storage backend: the functions
that look at a checkpoint take the :class:`~megatron_async.storage.backend.CheckpointStorage`
that serves it (``storage_for(checkpoint_dir)``), which also writes the small files
atomically and durably.

A ``torch_dist`` checkpoint directory holds:

* data files ``__{rank}_{bucket}.distcp`` (PyTorch DCP's ``torch_save`` layout), written
  by every rank's background writer;
* one checksum record per rank, :func:`checksum_record_name` (``megatron_async_checksums_rank{N}.json``):
  the xxh3 digest of every item that rank wrote, written by its background writer once its
  data files are durable (ours; stock loaders ignore them);
* :data:`DCP_METADATA_FILE` (``.metadata``), DCP's global metadata, written by the
  coordinator once every rank's data is durable;
* :data:`MEGATRON_METADATA_FILE` (``metadata.json``), megatron-core's backend record,
  written after ``.metadata``;
* up to megatron-core 0.18, :data:`COMMON_FILE` (``common.pt``), the non-sharded state
  (0.19+ stores it inside the DCP files as the ``common_state`` object).

A checkpoint is *complete* when both completion markers exist. Both are written last,
atomically, so a reader never sees a partial checkpoint marked complete; an overwrite
removes them first (:func:`remove_completion_markers`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, List, Union

if TYPE_CHECKING:
    from megatron_async.storage.backend import CheckpointStorage

__all__ = [
    "DCP_METADATA_FILE",
    "MEGATRON_METADATA_FILE",
    "COMMON_FILE",
    "checksum_record_name",
    "is_checksum_record",
    "COMPLETION_MARKERS",
    "TRACKER_FILE",
    "missing_completion_markers",
    "remove_completion_markers",
]

PathLike = Union[str, "os.PathLike[str]"]

DCP_METADATA_FILE = ".metadata"
"""PyTorch DCP's global metadata; the first completion marker."""

MEGATRON_METADATA_FILE = "metadata.json"
"""megatron-core's backend record (``sharded_backend``, version); the second marker."""

COMMON_FILE = "common.pt"
"""megatron-core's non-sharded state, in checkpoints of megatron-core up to 0.18."""

CHECKSUM_RECORD_PREFIX = "megatron_async_checksums_rank"
"""Start of the name of a rank's checksum record (see :func:`checksum_record_name`)."""


def checksum_record_name(rank: int) -> str:
    """The file in which ``rank``'s background writer records the xxh3 digest of every item
    it wrote (:mod:`megatron_async.integrity.checksums`)."""
    return f"{CHECKSUM_RECORD_PREFIX}{int(rank)}.json"


def is_checksum_record(name: str) -> bool:
    """Whether the file ``name`` is a rank's checksum record (:func:`checksum_record_name`)."""
    middle = name[len(CHECKSUM_RECORD_PREFIX):-len(".json")]
    return name.startswith(CHECKSUM_RECORD_PREFIX) and name.endswith(".json") and middle.isdigit()

COMPLETION_MARKERS = (MEGATRON_METADATA_FILE, DCP_METADATA_FILE)
"""The files whose presence makes a checkpoint complete (see the module docstring)."""

TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Megatron-LM's tracker in a save directory: the iteration of the latest complete save."""


def missing_completion_markers(checkpoint_dir: PathLike, storage: "CheckpointStorage") -> List[str]:
    """The completion markers that ``checkpoint_dir`` lacks (all of them without a directory).

    The one completeness rule of the format (no content check); listing, resume and the
    tracker all use it.

    Args:
        checkpoint_dir: the checkpoint directory (or ``msc://`` prefix).
        storage: the storage that serves it (:func:`~megatron_async.storage.storage_for`).
    """
    return [
        name for name in COMPLETION_MARKERS
        if not storage.is_file(os.path.join(checkpoint_dir, name))
    ]


def remove_completion_markers(checkpoint_dir: PathLike, storage: "CheckpointStorage") -> List[str]:
    """Make a checkpoint read as incomplete before anything of it changes (coordinator).

    Removes the markers and syncs the directory, so that after a crash in the middle of
    an overwrite no loader takes a mix of old and new files for a complete checkpoint.

    Returns:
        The names of the markers that were removed.
    """
    removed = [
        name for name in COMPLETION_MARKERS
        if storage.remove(os.path.join(checkpoint_dir, name))
    ]
    if removed:
        storage.sync_dir(os.fspath(checkpoint_dir))
    return removed
