"""The on-disk format in one place: file names, completion markers and durable writes.

Everything that names a file of a checkpoint, decides whether a checkpoint is complete,
or writes a small file that must survive a crash goes through this module, on any side
(trainer, coordinator rank, background writer). It imports neither torch nor
megatron-core, so the command-line tools can use it cheaply.

A ``torch_dist`` checkpoint directory holds:

* data files ``__{rank}_{bucket}.distcp`` (PyTorch DCP's ``torch_save`` layout), written
  by every rank's background writer;
* :data:`CHECKSUM_FILE`, the xxh3 digest of every item (ours; stock loaders ignore it);
* :data:`DCP_METADATA_FILE` (``.metadata``), DCP's global metadata, written by the
  coordinator once every rank's data is durable;
* :data:`MEGATRON_METADATA_FILE` (``metadata.json``), megatron-core's backend record,
  written after ``.metadata``;
* on megatron-core 0.16 and older, :data:`COMMON_FILE` (``common.pt``), the non-sharded
  state (0.17+ stores it inside the DCP files as the ``common_state`` object).

A checkpoint is *complete* when both completion markers exist. Both are written last,
atomically, so a reader never sees a partial checkpoint marked complete; an overwrite
removes them first (:func:`remove_completion_markers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import BinaryIO, Iterator, List, Union

from megatron_async.storage.locations import is_object_url

__all__ = [
    "DCP_METADATA_FILE",
    "MEGATRON_METADATA_FILE",
    "COMMON_FILE",
    "CHECKSUM_FILE",
    "COMPLETION_MARKERS",
    "TRACKER_FILE",
    "fsync_path",
    "atomic_output",
    "write_atomically",
    "remove_file",
    "has_completion_markers",
    "missing_completion_markers",
    "remove_completion_markers",
]

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

DCP_METADATA_FILE = ".metadata"
"""PyTorch DCP's global metadata; the first completion marker."""

MEGATRON_METADATA_FILE = "metadata.json"
"""megatron-core's backend record (``sharded_backend``, version); the second marker."""

COMMON_FILE = "common.pt"
"""megatron-core's non-sharded state, in checkpoints of megatron-core 0.16 and older."""

CHECKSUM_FILE = "megatron_async_checksums.json"
"""Our per-item xxh3 digests, written before ``.metadata``."""

COMPLETION_MARKERS = (MEGATRON_METADATA_FILE, DCP_METADATA_FILE)
"""Files whose presence makes a checkpoint directory complete; both are written only after
every rank's data is durable."""

TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Megatron-LM's tracker in a save directory: the iteration of the latest complete save."""


def fsync_path(path: PathLike, best_effort: bool = False) -> None:
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


@contextlib.contextmanager
def atomic_output(path: PathLike) -> Iterator[BinaryIO]:
    """Open a binary stream whose content replaces ``path`` atomically when the block ends.

    The stream is a uniquely named temporary file beside ``path``. When the block ends
    without an exception, the file is fsynced, renamed over ``path`` and the directory
    fsynced (best effort: some network file systems cannot), so the rename itself is
    durable when the block is left; a crash at any moment leaves the old file or the
    new one, whole. If the block raises, the temporary file is removed and ``path`` is
    untouched.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp_path = os.path.join(
        directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    try:
        with open(tmp_path, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        try:
            os.remove(tmp_path)
        except OSError:
            pass
        raise
    fsync_path(directory, best_effort=True)


def write_atomically(path: PathLike, data: Union[bytes, str]) -> None:
    """Replace ``path`` by ``data`` durably and atomically (see :func:`atomic_output`).

    An ``msc://`` URL is one PUT, which the store makes visible whole or not at all
    (:func:`megatron_async.storage.objects.put_object`).

    Args:
        path: the file (or object URL) to write.
        data: its whole content; ``str`` is written as UTF-8.
    """
    payload = data.encode() if isinstance(data, str) else data
    if is_object_url(path):
        from megatron_async.storage.objects import put_object

        put_object(os.fspath(path), payload)
        return
    with atomic_output(path) as stream:
        stream.write(payload)


def remove_file(path: PathLike) -> bool:
    """Remove a file or an ``msc://`` object; return whether there was one."""
    if is_object_url(path):
        from megatron_async.storage.objects import delete_object

        return delete_object(os.fspath(path))
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    return True


def missing_completion_markers(checkpoint_dir: PathLike) -> List[str]:
    """The completion markers that ``checkpoint_dir`` lacks (all of them without a directory).

    The one completeness rule of the format (no content check); listing, resume and the
    tracker all use it. An ``msc://`` prefix has no directory of its own: its markers are
    objects looked up in the store.
    """
    if is_object_url(checkpoint_dir):
        from megatron_async.storage.objects import object_exists

        return [
            name for name in COMPLETION_MARKERS
            if not object_exists(os.path.join(checkpoint_dir, name))
        ]
    if not os.path.isdir(checkpoint_dir):
        return list(COMPLETION_MARKERS)
    return [
        name for name in COMPLETION_MARKERS
        if not os.path.isfile(os.path.join(checkpoint_dir, name))
    ]


def has_completion_markers(checkpoint_dir: PathLike) -> bool:
    """Whether ``checkpoint_dir`` holds every completion marker (see
    :func:`missing_completion_markers`)."""
    return not missing_completion_markers(checkpoint_dir)


def remove_completion_markers(checkpoint_dir: PathLike) -> List[str]:
    """Make a checkpoint read as incomplete before anything of it changes (coordinator).

    Removes the markers and fsyncs the directory, so that after a crash in the middle of
    an overwrite no loader takes a mix of old and new files for a complete checkpoint.

    Returns:
        The names of the markers that were removed.
    """
    removed = [
        name for name in COMPLETION_MARKERS if remove_file(os.path.join(checkpoint_dir, name))
    ]
    if removed and not is_object_url(checkpoint_dir):
        fsync_path(checkpoint_dir, best_effort=True)
    return removed
