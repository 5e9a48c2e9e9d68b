"""End-to-end checksums of checkpoint items: computed while writing, checked on demand.

XXH3-64 (chosen for its speed: docs/design.md, "End-to-end checksums") is a corruption
check (truncation, bit flips, torn writes), not a defence against tampering. Each rank
records its own items, so a commit gathers nothing per item.

* The background writer hashes every item's bytes with :func:`new_hasher` on their way
  to the file (``megatron_async.writer.bucket_io``), then records its rank's checksums
  in its own file (:func:`write_rank_record`).
* :func:`read_checksums` reads the records of a checkpoint (those of the items its
  ``.metadata`` stores) and :func:`verify_items` re-reads and re-hashes items (the ``verify``
  tool and the opt-in load-time check).
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
from typing import Any, Iterable, List, Optional

from megatron_async.format import checksum_record_name, is_checksum_record
from megatron_async.buckets.bucket_file import ALGORITHM, new_hasher
from megatron_async.storage.backend import CheckpointStorage, storage_for

__all__ = [
    "ALGORITHM",
    "ItemChecksum",
    "new_hasher",
    "read_checksum_file",
    "write_rank_record",
    "read_checksums",
    "verify_items",
]

_FORMAT = "megatron_async.integrity.checksums/1"
_READ_CHUNK_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class ItemChecksum:
    """The checksum of one stored item: where its bytes are and what they hash to."""

    file: str
    offset: int
    length: int
    digest: str
    fqn: str
    chunk_offsets: Optional[List[int]] = None

    def describe(self) -> str:
        where = f"{self.fqn}" + (f" chunk {self.chunk_offsets}" if self.chunk_offsets else "")
        return f"{where} in {self.file} (bytes {self.offset}..{self.offset + self.length})"


def read_checksum_file(checkpoint_dir: str, name: str) -> Optional[List[ItemChecksum]]:
    """The checksums recorded in the file ``name`` of a checkpoint, or None without it."""
    path = os.path.join(checkpoint_dir, name)
    try:
        payload = json.loads(storage_for(checkpoint_dir).read(path))
    except FileNotFoundError:
        return None
    if payload.get("algorithm") != ALGORITHM:
        raise ValueError(f"{path}: unsupported checksum algorithm {payload.get('algorithm')!r}")
    return [ItemChecksum(**item) for item in payload["items"]]


def write_rank_record(checkpoint_dir: str, rank: int, results: Iterable[Any]) -> None:
    """Record the checksums of the items ``rank`` wrote, durably (background writer).

    Runs once the rank's data files are durable and before it reports its write done,
    so the record is durable before the coordinator writes ``.metadata``. A rank whose
    results carry no digest (checksums off) removes a record an earlier save into the
    same directory left, which would otherwise describe other bytes.
    """
    storage = storage_for(checkpoint_dir)
    path = os.path.join(checkpoint_dir, checksum_record_name(rank))
    records = []  # as the record file stores them, without an object per item
    for result in results:
        digest = getattr(result, "checksum", None)
        if digest is None:
            continue
        where, index = result.storage_data, result.index
        records.append(
            {
                "file": where.relative_path,
                "offset": where.offset,
                "length": where.length,
                "digest": digest,
                "fqn": index.fqn,
                "chunk_offsets": None if index.offset is None else list(index.offset),
            }
        )
    if not records:
        storage.remove(path)
        return
    records.sort(key=operator.itemgetter("file", "offset"))
    payload = {"format": _FORMAT, "algorithm": ALGORITHM, "rank": int(rank), "items": records}
    storage.write_atomically(path, json.dumps(payload))


def read_checksums(checkpoint_dir: str) -> Optional[List[ItemChecksum]]:
    """Every recorded checksum of the items of a checkpoint, or None when it has none.

    Reads the per-rank records; a record of an item that ``.metadata`` does not store (a
    rank that wrote in an earlier, unfinished save into the same directory, or a chunk
    without elements that several ranks wrote) is left out, so the result describes
    exactly the checkpoint's stored items.
    """
    storage = storage_for(checkpoint_dir)
    names = [
        name for name, num_bytes in storage.list_dir(checkpoint_dir)
        if num_bytes is not None and is_checksum_record(name)
    ]
    if not names:
        return None
    metadata = storage.dcp_reader(checkpoint_dir).read_metadata()
    stored = {
        (info.relative_path, info.offset, info.length) for info in (metadata.storage_data or {}).values()
    }
    items: List[ItemChecksum] = []
    for name in names:
        for item in read_checksum_file(checkpoint_dir, name) or ():
            if (item.file, item.offset, item.length) in stored:
                items.append(item)
    return items


def _hash_range(storage: CheckpointStorage, path: str, offset: int, length: int) -> Optional[str]:
    """The digest of the bytes of ``path`` in ``offset..offset+length``; None when the file
    ends before them; ``FileNotFoundError`` without the file."""
    hasher = new_hasher()
    position, end = offset, offset + length
    while position < end:
        block = storage.read_range(path, position, min(end - position, _READ_CHUNK_BYTES))
        if not block:
            return None
        hasher.update(block)
        position += len(block)
    return hasher.hexdigest()


def verify_items(checkpoint_dir: str, items: Iterable[ItemChecksum]) -> List[str]:
    """Re-hash ``items`` from disk; return one message per damaged item (empty if intact).

    Args:
        items: the checksums to check (all of them, or one rank's share).
    """
    storage = storage_for(checkpoint_dir)
    problems: List[str] = []
    for item in items:
        try:
            digest = _hash_range(storage, os.path.join(checkpoint_dir, item.file), item.offset, item.length)
        except FileNotFoundError:
            problems.append(f"{item.describe()}: file {item.file} is missing")
            continue
        if digest is None:
            problems.append(f"{item.describe()}: file {item.file} is truncated")
        elif digest != item.digest:
            problems.append(f"{item.describe()}: checksum mismatch (recorded {item.digest}, found {digest})")
    return problems

