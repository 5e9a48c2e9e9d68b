"""Whether a save stores every item where the previous save of its structure did.

Runs on every rank, in a save's finalization (training thread). A warm save (cached plans,
unchanged structure) lays its buckets out exactly as the previous one: same files, same
offsets, same lengths. Each rank compares its own write results' storage locations with
the ones it kept from its previous committed save (O(its items), no communication); one
all-reduce then agrees that nothing changed anywhere
(:func:`~megatron_async.saver.finalize.save_state_dict_async_finalize`), and the
coordinator writes ``.metadata`` from the bytes of the previous commit
(:func:`~megatron_async.writer.commit.commit_unchanged`) without gathering any rank's
results. Anything else takes the full path, on every rank.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional, Sequence, Tuple

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.writer.metadata_bytes import MetadataTemplate

__all__ = ["CommitCache", "storage_layout"]

StorageLayout = List[Tuple[Any, Any]]
"""``(MetadataIndex, storage location)`` of each of a rank's write results, in order."""


def storage_layout(results: Sequence[WriteResult]) -> StorageLayout:
    """Where each of a rank's items was stored (every rank)."""
    return [(result.index, result.storage_data) for result in results]


class CommitCache:
    """What one rank keeps of its previous committed save, to recognize a warm save.

    Owned by the save strategy (one per strategy, not copied with it) and handed to each
    save's writer. Every rank keeps its own storage layout; the coordinator also keeps
    the template of the ``.metadata`` it committed and the global metadata object (the cached structure) it
    was built from.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layout: Optional[StorageLayout] = None
        self._structure: Optional[Metadata] = None
        self._committed: Optional[MetadataTemplate] = None

    def matches(
        self, layout: StorageLayout, structure: Optional[Metadata], is_coordinator: bool
    ) -> bool:
        """Whether this rank may skip sending its results: it stored every item where its
        previous committed save did, and on the coordinator, the global metadata is the
        very object that save's ``.metadata`` was built from."""
        with self._lock:
            if self._layout is None or layout != self._layout:
                return False
            if is_coordinator:
                return (
                    self._committed is not None
                    and structure is not None
                    and structure is self._structure
                )
            return True

    @property
    def committed(self) -> Optional[MetadataTemplate]:
        """The coordinator's previous commit (None elsewhere, or before one)."""
        return self._committed

    def forget(self) -> None:
        """Drop everything (every rank, before a full commit): a save that fails halfway
        must not leave a layout that matches a commit that was never written."""
        with self._lock:
            self._layout = self._structure = self._committed = None

    def remember(
        self,
        layout: StorageLayout,
        structure: Optional[Metadata] = None,
        committed: Optional[MetadataTemplate] = None,
    ) -> None:
        """Keep a successfully committed save's layout (every rank) and, on the coordinator,
        its metadata and the structure it came from."""
        with self._lock:
            self._layout, self._structure, self._committed = layout, structure, committed
