"""End-to-end checksums of checkpoint items: computed while writing, checked on demand.

Why xxHash (XXH3, 64-bit): it hashes at memory speed (tens of GB/s per core), so it
adds little to a write that is bound by the disk or the memory copy, and the
``xxhash`` package is a small, maintained binding of the reference C library. It is a
corruption check (truncation, bit flips, torn writes), not a defence against tampering.

Where each piece runs:

* :class:`HashingWriter` wraps the output file in the background writer and hashes
  every byte on its way to the file, so no second read pass and no work on the
  training thread is needed.
* The coordinator writes every rank's item checksums into :data:`CHECKSUM_FILE` next
  to the data files, *before* DCP's ``.metadata`` marks the checkpoint complete. Stock
  loaders ignore the extra file, so the checkpoint stays a plain ``torch_dist`` one.
* :func:`verify_items` re-reads and re-hashes items (the ``verify`` tool and the
  opt-in load-time check).
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
from typing import Callable, Dict, Iterable, List, Optional

import xxhash

__all__ = [
    "CHECKSUM_FILE",
    "ALGORITHM",
    "ItemChecksum",
    "HashingWriter",
    "write_checksum_file",
    "read_checksum_file",
    "verify_items",
]

CHECKSUM_FILE = "megatron_async_checksums.json"
ALGORITHM = "xxh3_64"
_FORMAT = "megatron_async.checksums/1"
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


class HashingWriter(io.RawIOBase):
    """A write-only stream that hashes what it forwards to ``target`` (background side).

    Call :meth:`start_item` before an item is written and :meth:`finish_item` after;
    the digest covers exactly the bytes written in between. With ``hashing=False`` it
    only forwards, and still keeps :attr:`write_error`.

    Attributes:
        write_error: the first ``OSError`` the target raised. ``torch.save`` swallows
            exceptions of a stream's ``write`` and reports only "unexpected pos"; the
            writer re-raises this one instead, so a full disk reads as ENOSPC.
    """

    def __init__(self, target, hashing: bool = True):
        super().__init__()
        self._target = target
        self._hasher = xxhash.xxh3_64() if hashing else None
        self.write_error: Optional[OSError] = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        # Write everything or raise: a short write (a disk filling up) must surface as the
        # OSError of the next attempt, not as a silently shorter item.
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < view.nbytes:
                written = self._target.write(view[done:])
                if written is None:  # a buffered stream that accepted everything
                    written = view.nbytes - done
                if written == 0:
                    raise OSError(errno.EIO, f"the file accepted no bytes after {done} of {view.nbytes}")
                done += written
        except OSError as exc:
            if self.write_error is None:
                self.write_error = exc
            raise
        if self._hasher is not None:
            self._hasher.update(view)
        return view.nbytes

    def tell(self) -> int:
        return self._target.tell()

    def flush(self) -> None:
        self._target.flush()

    def close(self) -> None:
        # Closing the wrapper must not close the shared file: DCP closes per-item streams.
        io.RawIOBase.close(self)

    def start_item(self) -> None:
        if self._hasher is not None:
            self._hasher.reset()

    def finish_item(self) -> Optional[str]:
        return self._hasher.hexdigest() if self._hasher is not None else None


def write_checksum_file(checkpoint_dir: str, items: Iterable[ItemChecksum]) -> None:
    """Write the checksum file atomically (coordinator, before ``.metadata``)."""
    payload = {
        "format": _FORMAT,
        "algorithm": ALGORITHM,
        "items": [dataclasses.asdict(item) for item in sorted(items, key=lambda i: (i.file, i.offset))],
    }
    final_path = os.path.join(checkpoint_dir, CHECKSUM_FILE)
    tmp_path = final_path + ".tmp"
    with open(tmp_path, "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, final_path)


def read_checksum_file(checkpoint_dir: str) -> Optional[List[ItemChecksum]]:
    """The recorded checksums, or None when the checkpoint has none."""
    path = os.path.join(checkpoint_dir, CHECKSUM_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        payload = json.load(f)
    if payload.get("algorithm") != ALGORITHM:
        raise ValueError(f"{path}: unsupported checksum algorithm {payload.get('algorithm')!r}")
    return [ItemChecksum(**item) for item in payload["items"]]


def _hash_range(path: str, offset: int, length: int) -> Optional[str]:
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as f:
        f.seek(offset)
        remaining = length
        while remaining > 0:
            block = f.read(min(remaining, _READ_CHUNK_BYTES))
            if not block:
                return None  # the file ends before the item does
            hasher.update(block)
            remaining -= len(block)
    return hasher.hexdigest()


def verify_items(
    checkpoint_dir: str,
    items: Iterable[ItemChecksum],
    on_progress: Optional[Callable[[int], None]] = None,
) -> List[str]:
    """Re-hash ``items`` from disk; return one message per damaged item (empty if intact).

    Args:
        checkpoint_dir: the checkpoint directory.
        items: the checksums to check (all of them, or one rank's share).
        on_progress: called with the number of bytes checked after each item.
    """
    problems: List[str] = []
    for item in items:
        path = os.path.join(checkpoint_dir, item.file)
        if not os.path.exists(path):
            problems.append(f"{item.describe()}: file {item.file} is missing")
            continue
        digest = _hash_range(path, item.offset, item.length)
        if digest is None:
            problems.append(f"{item.describe()}: file {item.file} is truncated")
        elif digest != item.digest:
            problems.append(f"{item.describe()}: checksum mismatch (recorded {item.digest}, found {digest})")
        if on_progress is not None:
            on_progress(item.length)
    return problems


def group_by_file(items: Iterable[ItemChecksum]) -> Dict[str, List[ItemChecksum]]:
    """Items grouped by the file that holds them."""
    grouped: Dict[str, List[ItemChecksum]] = {}
    for item in items:
        grouped.setdefault(item.file, []).append(item)
    return grouped
