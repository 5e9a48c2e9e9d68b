"""Commit a checkpoint on the coordinator rank: checksums, then ``.metadata``, both durable.

Runs on the coordinator only, inside the finalization of a save, after every rank
reported a successful write. Order matters: the data files are fsynced by their
writers; here the checksum file (or the removal of a stale one) comes first, then
DCP's ``.metadata`` (the first completion marker), each written atomically with its
directory fsynced (``CheckpointStorage.write_atomically`` of the storage that
:func:`~megatron_async.storage.storage_for` chooses once per commit).
"""

from __future__ import annotations

import copy
import os
import pickle
from typing import Any, Dict, Iterable, List, Optional, Tuple

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.core.gc_pause import paused_gc
from megatron_async.format import CHECKSUM_FILE, COMMON_FILE, DCP_METADATA_FILE
from megatron_async.integrity import checksums
from megatron_async.integrity.staleness import ChangeReport, SaveDigestHistory
from megatron_async.storage.backend import CheckpointStorage, storage_for

__all__ = ["commit_checkpoint"]


@paused_gc()  # hundreds of thousands of records and index keys; no cycles
def commit_checkpoint(
    checkpoint_dir: str,
    metadata: Metadata,
    results: List[List[WriteResult]],
    storage_meta: Any,
    digest_history: Optional[SaveDigestHistory] = None,
) -> Optional[ChangeReport]:
    """Write the checksums and ``.metadata`` of a checkpoint whose data is durable (coordinator).

    Args:
        checkpoint_dir: the checkpoint directory.
        metadata: the global metadata; not modified (it may be a cached one reused next
            save): a copy gets every item's storage location.
        results: every rank's write results, in rank order.
        storage_meta: the writer's ``storage_meta()``.
        digest_history: the job's previous digests, to report what changed (and warn
            when nothing did); None skips the comparison.

    Returns:
        The comparison with the previous save, when there was a history and checksums.

    Raises:
        StaleCheckpointError: the history is set to fail stale saves and nothing changed;
            nothing is written then.
    """
    stored = _stored_results(results)
    records, digests = _checksum_records(stored.values())
    report = None
    if digest_history is not None and digests:
        report = digest_history.record(checkpoint_dir, digests)
    metadata = copy.copy(metadata)
    metadata.storage_data = {index: result.storage_data for index, result in stored.items()}
    metadata.storage_meta = storage_meta
    if hasattr(metadata, "version"):
        from torch.distributed.checkpoint import filesystem as dcp_filesystem

        metadata.version = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", metadata.version)
    # megatron-core (0.16 and older) writes common.pt without an fsync; the checkpoint
    # must not be marked complete before it is durable too.
    # (An object in a store is durable once its PUT was acknowledged.)
    storage = storage_for(checkpoint_dir)
    storage.sync(os.path.join(checkpoint_dir, COMMON_FILE))
    _write_checksums(storage, checkpoint_dir, records)
    storage.write_atomically(os.path.join(checkpoint_dir, DCP_METADATA_FILE), pickle.dumps(metadata))
    return report


def _stored_results(results: List[List[WriteResult]]) -> Dict[MetadataIndex, WriteResult]:
    """The one write result that ``.metadata`` records per item (coordinator).

    Each item is written by one rank, except tensor chunks without elements: with uneven
    splits (distributed optimizer buckets, MoE) several ranks hold one at the same offset,
    sometimes at the offset of another rank's chunk with data, and decentralized plans
    are not deduplicated, so each of them writes its own. ``.metadata`` can record one
    storage entry per ``(fqn, offset)`` (``MetadataIndex`` equality ignores the index
    hint): the chunk with data wins, else the lowest rank's empty chunk. Nothing is lost,
    since an empty chunk is never read.
    """
    stored = {result.index: result for rank_results in results for result in rank_results}
    if len(stored) == sum(len(rank_results) for rank_results in results):
        return stored  # no item written twice: the usual case, kept cheap
    stored = {}
    for rank_results in results:
        for result in rank_results:
            kept = stored.setdefault(result.index, result)
            if kept is not result and _is_empty(kept) and not _is_empty(result):
                stored[result.index] = result
    return stored


def _is_empty(result: WriteResult) -> bool:
    return getattr(result, "empty_chunk", False)


def _checksum_records(results: Iterable[WriteResult]) -> Tuple[List[Dict[str, Any]], List[Tuple[Any, str]]]:
    """The checksum file's records of the stored items, and the digests of those with data.

    One pass over every rank's items (coordinator, training thread): the records are
    built as the checksum file stores them, without an intermediate object per item;
    the ``((fqn, chunk offsets), digest)`` pairs feed the stale-checkpoint comparison,
    which leaves out empty chunks.
    """
    records, digests = [], []
    for result in results:
        digest = getattr(result, "checksum", None)
        if digest is None:
            continue
        where, index = result.storage_data, result.index
        chunk_offsets = None if index.offset is None else tuple(index.offset)
        records.append(
            {
                "file": where.relative_path,
                "offset": where.offset,
                "length": where.length,
                "digest": digest,
                "fqn": index.fqn,
                "chunk_offsets": None if chunk_offsets is None else list(chunk_offsets),
            }
        )
        if not _is_empty(result):
            digests.append(((index.fqn, chunk_offsets), digest))
    return records, digests


def _write_checksums(storage: CheckpointStorage, checkpoint_dir: str, records: List[Dict[str, Any]]) -> None:
    """Write the checksum records, or drop a stale checksum file (coordinator).

    Runs before ``.metadata`` is written, so a checkpoint that looks complete always has
    the checksums of exactly the items its metadata records (or none at all).
    """
    if records:
        checksums.write_checksum_records(checkpoint_dir, records)
    else:
        storage.remove(os.path.join(checkpoint_dir, CHECKSUM_FILE))
