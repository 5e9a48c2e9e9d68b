"""Commit a checkpoint: ``.metadata``, durable, after all the data.

Runs in a save's finalization, the commit itself on the coordinator only, after every
rank reported a successful write (its data files and checksum record are durable by
then): ``common.pt`` is synced, and DCP's ``.metadata`` (the first completion marker) is
written atomically with its directory fsynced.

Two ways in: :func:`commit_checkpoint` builds ``.metadata`` from every rank's write
results and returns the template with which :func:`commit_unchanged` writes a warm save
from the same bytes (:mod:`megatron_async.writer.metadata_bytes`). Each rank's record of
its previous save (:class:`~megatron_async.saver.finalize.PreviousSave`) tells whether
its save is warm, before one all-reduce agrees (see
"Warm saves cost the coordinator O(1)" in docs/design.md). Earlier in the save,
:func:`unmark_before_rewrite` makes a complete checkpoint in the directory read as
incomplete before a data file is rewritten.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.core.save_directories import SaveDirectories
from megatron_async.core.gc_pause import paused_gc
from megatron_async.format import (
    COMMON_FILE, DCP_METADATA_FILE, remove_completion_markers,
)
from megatron_async.storage.backend import storage_for
from megatron_async.writer.metadata_bytes import PICKLE_PROTOCOL, MetadataTemplate, metadata_pickle

__all__ = [
    "StorageLayout", "commit_checkpoint", "commit_unchanged", "storage_layout", "unmark_before_rewrite",
]

logger = logging.getLogger(__name__)


@paused_gc()  # hundreds of thousands of records and index keys; no cycles
def commit_checkpoint(
    checkpoint_dir: str,
    metadata: Metadata,
    results: List[List[WriteResult]],
    storage_meta: Any,
) -> Optional[MetadataTemplate]:
    """Write ``.metadata`` of a checkpoint whose data is durable, from every rank's results
    (coordinator).

    Args:
        checkpoint_dir: the checkpoint directory.
        metadata: the global metadata; not modified (it may be a cached one reused next
            save): a copy gets every item's storage location.
        results: every rank's write results, in rank order.
        storage_meta: the writer's ``storage_meta()``.

    Returns:
        The template of what was written, for :func:`commit_unchanged` of a later save;
        None where none can be made (a ``storage_meta`` without string fields).
    """
    metadata = copy.copy(metadata)
    metadata.storage_data = _storage_data(results)
    metadata.storage_meta = storage_meta
    if hasattr(metadata, "version"):
        from torch.distributed.checkpoint import filesystem as dcp_filesystem

        metadata.version = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", metadata.version)
    data, template = metadata_pickle(metadata)
    _write_metadata(checkpoint_dir, data)
    return template


def commit_unchanged(checkpoint_dir: str, template: MetadataTemplate, storage_meta: Any) -> None:
    """Write ``.metadata`` of a save whose every item is stored where the committed save
    stored it, from that save's bytes (coordinator; no per-item work).

    Args:
        checkpoint_dir: the checkpoint directory.
        template: what :func:`commit_checkpoint` returned for the previous save of this
            structure.
        storage_meta: this save's writer's ``storage_meta()``.
    """
    data = template.render_pieces(storage_meta)
    if data is None:  # a value the template cannot take (not a short string): O(items)
        metadata = pickle.loads(template.data)
        metadata.storage_meta = storage_meta
        data = pickle.dumps(metadata, protocol=PICKLE_PROTOCOL)
    _write_metadata(checkpoint_dir, data)


def _write_metadata(checkpoint_dir: str, data: Union[bytes, List[Any]]) -> None:
    """Make ``common.pt`` durable, then write ``.metadata``."""
    # megatron-core (up to 0.18) writes common.pt without an fsync; the checkpoint
    # must not be marked complete before it is durable too.
    # (An object in a store is durable once its PUT was acknowledged.)
    storage = storage_for(checkpoint_dir)
    # A step left behind (an unmarking of this directory, say) could still land over it.
    SaveDirectories.of_process().refuse_if_stuck()

    def write() -> None:
        storage.sync(os.path.join(checkpoint_dir, COMMON_FILE))
        storage.write_atomically(os.path.join(checkpoint_dir, DCP_METADATA_FILE), data)

    # Only the file-system calls run on the bounded helper thread: the metadata was built
    # here, under this thread's paused_gc, which a thread left behind would never end.
    SaveDirectories.of_process().run_bounded(f"writing .metadata of {checkpoint_dir}", write)


def _storage_data(results: List[List[WriteResult]]) -> Dict[MetadataIndex, Any]:
    """The storage location ``.metadata`` records per item, from one write result each
    (coordinator).

    Several ranks may write an empty chunk at one offset (see "Zero-length shards" in
    docs/design.md), and ``.metadata`` records one entry per ``(fqn, offset)``
    (``MetadataIndex`` equality ignores the index hint): the chunk with data wins, else
    the lowest rank's empty chunk, which is never read.
    """
    storage_data = {
        result.index: result.storage_data for rank_results in results for result in rank_results
    }
    if len(storage_data) == sum(len(rank_results) for rank_results in results):
        return storage_data  # no item written twice: the usual case, one pass (DCP's cost)
    stored: Dict[MetadataIndex, WriteResult] = {}
    for rank_results in results:
        for result in rank_results:
            kept = stored.setdefault(result.index, result)
            if kept is not result and _is_empty(kept) and not _is_empty(result):
                stored[result.index] = result
    return {index: result.storage_data for index, result in stored.items()}


def _is_empty(result: WriteResult) -> bool:
    return getattr(result, "empty_chunk", False)


def unmark_before_rewrite(checkpoint_dir: str, strict: bool = False) -> None:
    """Remove the completion markers of a checkpoint that this save is about to rewrite
    (coordinator, once every rank agreed that planning succeeded, before any data file
    changes; best effort: logs, never raises, unless ``strict``).

    DCP's own writer rewrites the data files in place beside the old ``.metadata``: a save
    that fails midway would leave a torn checkpoint that reads as complete (see
    "Overwriting a complete checkpoint" in docs/design.md). The strategy runs this
    ``strict`` inside an agreement, only when its target check saw a complete checkpoint;
    the reference API (``save_state_dict_async_plan``) on every save, best effort. Local
    directories only: in an object store it would cost requests on every save.
    """
    storage = storage_for(checkpoint_dir)
    if storage.needs_msc:
        return
    try:  # after the agreement: unless the caller agrees on it, it must not fail alone
        removed = SaveDirectories.of_process().run_bounded(
            f"unmarking {checkpoint_dir}",
            lambda: remove_completion_markers(checkpoint_dir, storage),
        )
    except Exception as exc:
        if strict:
            raise
        logger.error(
            "could not remove the completion markers in %s before rewriting it (%s): a save "
            "that fails midway may leave a checkpoint that reads as complete", checkpoint_dir, exc,
        )
        return
    if removed:
        logger.warning(
            "overwriting the checkpoint in %s: its completion markers %s were removed "
            "before its files are rewritten", checkpoint_dir, removed,
        )


StorageLayout = List[Tuple[Any, Any]]
"""``(MetadataIndex, storage location)`` of each of a rank's write results, in order."""


def storage_layout(results: Sequence[WriteResult]) -> StorageLayout:
    """Where each of a rank's items was stored (every rank)."""
    return [(result.index, result.storage_data) for result in results]
