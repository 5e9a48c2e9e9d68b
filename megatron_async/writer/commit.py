"""Commit a checkpoint on the coordinator rank: checksums, then ``.metadata``, both durable.

Runs on the coordinator only, inside the finalization of a save, after every rank
reported a successful write. Order matters: the data files are fsynced by their
writers; here the checksum file (or the removal of a stale one) comes first, then
DCP's ``.metadata`` (the first completion marker), each written atomically with its
directory fsynced (:func:`megatron_async.format.write_atomically`).
"""

from __future__ import annotations

import copy
import os
import pickle
from typing import Any, List

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.format import CHECKSUM_FILE, COMMON_FILE, DCP_METADATA_FILE, fsync_path, write_atomically
from megatron_async.integrity import checksums

__all__ = ["commit_checkpoint"]


def commit_checkpoint(
    checkpoint_dir: str,
    metadata: Metadata,
    results: List[List[WriteResult]],
    storage_meta: Any,
) -> None:
    """Write the checksums and ``.metadata`` of a checkpoint whose data is durable (coordinator).

    Args:
        checkpoint_dir: the checkpoint directory.
        metadata: the global metadata; not modified (it may be a cached one reused next
            save): a copy gets every item's storage location.
        results: every rank's write results, in rank order.
        storage_meta: the writer's ``storage_meta()``.
    """
    metadata = copy.copy(metadata)
    metadata.storage_data = {
        result.index: result.storage_data for rank_results in results for result in rank_results
    }
    metadata.storage_meta = storage_meta
    if hasattr(metadata, "version"):
        from torch.distributed.checkpoint import filesystem as dcp_filesystem

        metadata.version = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", metadata.version)
    # megatron-core (0.16 and older) writes common.pt without an fsync; the checkpoint
    # must not be marked complete before it is durable too.
    common = os.path.join(checkpoint_dir, COMMON_FILE)
    if os.path.exists(common):
        fsync_path(common)
    _record_checksums(checkpoint_dir, results)
    write_atomically(os.path.join(checkpoint_dir, DCP_METADATA_FILE), pickle.dumps(metadata))


def _record_checksums(checkpoint_dir: str, results: List[List[WriteResult]]) -> None:
    """Write every rank's item digests, or drop a stale checksum file (coordinator).

    Runs before ``.metadata`` is written, so a checkpoint that looks complete always has
    the checksums of exactly its own items (or none at all). The records are built as the
    checksum file stores them, without an intermediate object per item: this runs on the
    training thread, with every rank's items.
    """
    records = []
    for rank_results in results:
        for result in rank_results:
            digest = getattr(result, "checksum", None)
            if digest is None:
                continue
            storage, index = result.storage_data, result.index
            records.append(
                {
                    "file": storage.relative_path,
                    "offset": storage.offset,
                    "length": storage.length,
                    "digest": digest,
                    "fqn": index.fqn,
                    "chunk_offsets": None if index.offset is None else list(index.offset),
                }
            )
    if records:
        checksums.write_checksum_records(checkpoint_dir, records)
    else:
        try:
            os.remove(os.path.join(checkpoint_dir, CHECKSUM_FILE))
        except FileNotFoundError:
            pass
