"""Commit an asynchronous save once its background write is done (every rank).

The last of a save's three steps (plan, write, finalize; see
:mod:`megatron_async.saver.state_dict_saver`): every rank reports whether its write
succeeded, and only if all did does the coordinator write ``.metadata``. A failure
anywhere raises the same error on every rank.

One all-reduce carries, from every rank: did its write fail, did any of its items move
since its previous committed save (:class:`PreviousSave`), and its stale-checkpoint
counts (:mod:`megatron_async.integrity.staleness`). When no
rank's items moved (*warm*), nothing is gathered and the coordinator writes ``.metadata``
from the previous commit's bytes (:func:`~megatron_async.writer.commit.commit_unchanged`);
otherwise every rank's write results are gathered and the coordinator builds it (the
writer's ``finish``). One more small all-reduce agrees on whether the commit succeeded
(docs/design.md, "Warm saves cost the coordinator O(1)"). The coordinator's file writes
are bounded (:mod:`megatron_async.core.save_directories`; the metadata is built on this
thread), so a file system that stops answering fails the save on every rank instead of
holding rank 0 in an ``fsync``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Dict, Hashable, List, NamedTuple, Optional, Tuple

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron_async.core import coordination
from megatron_async.errors import CheckpointValidationError, RankFailure
from megatron_async.integrity.staleness import (
    ChangeReport, digests_of, judge_staleness,
)
from megatron_async.writer.commit import StorageLayout, commit_unchanged, storage_layout
from megatron_async.writer.metadata_bytes import MetadataTemplate

if TYPE_CHECKING:
    from megatron_async.writer.filesystem import FileSystemWriterAsync

__all__ = ["CommittedSave", "PreviousSave", "save_state_dict_async_finalize"]

logger = logging.getLogger(__name__)

_MOVED, _RANKS = 0, 1
"""Positions in the counts the finalization sums; the stale-checkpoint counts follow."""


class CommittedSave(NamedTuple):
    """One rank's record of a committed save."""

    checkpoint: str
    digests: Dict[Hashable, str]  # item key -> digest, of this rank's items with data
    layout: Optional[StorageLayout]  # where this rank stored its items (None: gather)
    structure: Optional[Metadata] = None  # the coordinator's global metadata object
    template: Optional[MetadataTemplate] = None  # the coordinator's ``.metadata``


class PreviousSave:
    """What one rank keeps of its saver's previous committed save (:attr:`last`), to tell
    whether a new save is warm (it stored every item where that save did) and whether it
    is stale (none of its digests changed).

    Owned by the save strategy (one per strategy, not copied with it) and handed to each
    save's finalization (every rank), which replaces :attr:`last` whole, in one
    assignment, once a save is committed.
    """

    def __init__(self) -> None:
        self.last: Optional[CommittedSave] = None

    def matches(self, layout: StorageLayout, structure: Optional[Metadata], is_coordinator: bool) -> bool:
        """Whether this rank may skip sending its results: it stored every item where its
        previous committed save did, and on the coordinator, the global metadata is the
        very object that save's ``.metadata`` was built from."""
        last = self.last
        if last is None or last.layout is None or layout != last.layout:
            return False
        return not is_coordinator or (
            last.template is not None and structure is not None and structure is last.structure
        )

    def compare(self, digests: Dict[Hashable, str]) -> ChangeReport:
        """This rank's digests of a save against its previous save's (every rank)."""
        last = self.last
        if last is None:
            return ChangeReport(len(digests), len(digests), None)
        changed = sum(last.digests.get(key) != digest for key, digest in digests.items())
        return ChangeReport(len(digests), changed, last.checkpoint)


def _local_results(
    storage_writer: "FileSystemWriterAsync", rank: int
) -> Tuple[List[Any], Optional[RankFailure]]:
    """This rank's write results, or its failure (every rank)."""
    try:
        results = storage_writer.retrieve_write_results()
        # The reference API returns a background failure as DCP's (exception, traceback).
        if isinstance(results, tuple) and len(results) == 2 and isinstance(results[0], BaseException):
            raise results[0]
        return results, None
    except Exception as exc:  # reported on every rank by the caller
        logger.error(
            "rank %d: background write of %s failed: %s", rank, storage_writer.checkpoint_id, exc
        )
        return [], getattr(exc, "failure", None) or RankFailure.from_exception(rank, "write", exc)


def save_state_dict_async_finalize(
    storage_writer: "FileSystemWriterAsync",
    global_metadata: Optional[Metadata],
    dist_wrapper: _DistWrapper,
    *,
    previous_save: Optional[PreviousSave] = None,
) -> Optional[ChangeReport]:
    """Commit the save once the background write is done on every rank (every rank).

    Args:
        storage_writer, global_metadata, dist_wrapper: what planning returned.
        previous_save: the record of the same saver's previous committed save (the
            strategy keeps one), which enables the warm path and the stale-checkpoint
            comparison; without it every finalization gathers the write results and
            nothing is compared.

    Returns:
        On the coordinator, what changed since the previous save when there is a
        ``previous_save`` and the save stored items; None elsewhere (the reference API
        returns nothing).

    Raises:
        AsyncSaveFailedError: on every rank, when the write failed on any rank or the
            coordinator could not write the metadata. No ``.metadata`` is written then.
    """
    checkpoint = str(storage_writer.checkpoint_id)
    group = dist_wrapper.group
    rank = coordination.get_rank()
    is_coordinator = dist_wrapper.is_coordinator
    previous = previous_save

    results, failure = _local_results(storage_writer, rank)
    layout = storage_layout(results) if failure is None else None
    moved = (
        failure is not None
        or previous is None
        or not previous.matches(layout, global_metadata, is_coordinator)
    )
    compared = previous is not None and failure is None
    digests = dict(digests_of(results)) if compared else {}
    comparison = previous.compare(digests) if compared else ChangeReport(0, 0, None)
    summed = coordination.agree(
        failure, coordination.save_failed(checkpoint), [int(moved), 1, *comparison.counts()], group
    )
    report = None
    if is_coordinator:  # the job-wide comparison, with its WARNING when nothing changed
        counts, ranks = summed[_RANKS + 1:], summed[_RANKS]
        report = ChangeReport.from_counts(counts, ranks, comparison.previous_checkpoint)
        judge_staleness(checkpoint, report)

    start = time.monotonic()
    warm = not summed[_MOVED]
    if not warm:
        if previous is not None and previous.last is not None:
            # A save that fails halfway must not leave a layout matching a commit that was
            # never written; the digests stay the previous save's.
            previous.last = previous.last._replace(layout=None, structure=None, template=None)
        all_results = coordination.gather_on_coordinator(results, dist_wrapper, "results")

    def commit() -> Optional[MetadataTemplate]:
        if warm:
            commit_unchanged(storage_writer.checkpoint_dir, previous.last.template, storage_writer.storage_meta())
            return None
        if global_metadata is None:
            raise CheckpointValidationError(
                f"the coordinator has no metadata for {checkpoint}; the plan cache was lost"
            )
        return storage_writer.finish(global_metadata, all_results)

    committed = coordination.run_on_coordinator("finalize", commit, checkpoint, group, is_coordinator)
    logger.debug(
        "rank %d: committed %s in %.3fs (%s)", rank, checkpoint, time.monotonic() - start,
        "warm: nothing gathered" if warm else "write results gathered",
    )
    if previous is not None:  # a warm save keeps the previous commit's layout and template
        kept = previous.last if warm else CommittedSave(
            checkpoint, digests, layout, global_metadata, committed if is_coordinator else None
        )
        previous.last = kept._replace(checkpoint=checkpoint, digests=digests)
    return report if report is not None and report.items else None

