"""Commit an asynchronous save once its background write is done (every rank).

The last of a save's three steps (plan, write, finalize; see
:mod:`megatron_async.saver.state_dict_saver`): every rank reports whether its write
succeeded, and only if all did does the coordinator write ``.metadata``. A failure
anywhere raises the same error on every rank.

Each rank's checksums are already in its own record file (its background writer wrote
it), so finalization gathers no checksum. One all-reduce (SUM, on the coordination
group) carries, from every rank: did its write fail, did any of its items move since its
previous committed save (:class:`~megatron_async.writer.commit.CommitCache`), and
its stale-checkpoint counts (:mod:`megatron_async.integrity.staleness`). Then:

* *warm* (no rank's items moved; the usual case of a save with cached plans): nothing is
  gathered; the coordinator writes ``.metadata`` from the bytes of the previous commit
  with this save's ``storage_meta`` (:func:`~megatron_async.writer.commit.commit_unchanged`);
* *full* (the first save, a changed structure on any rank, or no cache): every rank's
  write results are gathered and the coordinator builds ``.metadata`` from them
  (the writer's ``finish``).

Either way one more small all-reduce agrees on whether the coordinator's commit
succeeded, so a warm finalization costs two all-reduces of a few integers and no gather.
The coordinator's file writes are bounded (:mod:`megatron_async.core.save_directories`,
in :mod:`megatron_async.writer.commit`; the metadata is built on this thread): on a
file system that stops answering it fails in time for the other ranks to raise the same
error, instead of holding rank 0 in an ``fsync`` for good.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron_async.core import coordination
from megatron_async.errors import AsyncSaveFailedError, CheckpointValidationError, RankFailure
from megatron_async.integrity.staleness import (
    ChangeReport, SaveDigestHistory, StaleCheckpointError, digests_of,
)
from megatron_async.writer.commit import CommitCache, commit_unchanged, storage_layout
from megatron_async.writer.metadata_bytes import MetadataTemplate

if TYPE_CHECKING:
    from megatron_async.writer.filesystem import FileSystemWriterAsync

__all__ = ["save_state_dict_async_finalize"]

logger = logging.getLogger(__name__)

_MOVED, _RANKS = 0, 1
"""Positions in the counts the finalization sums; the stale-checkpoint counts follow."""


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
    commit_cache: Optional[CommitCache] = None,
    digest_history: Optional[SaveDigestHistory] = None,
) -> Optional[ChangeReport]:
    """Commit the save once the background write is done on every rank (every rank).

    Costs what the module docstring says (a warm save gathers nothing).

    Args:
        storage_writer, global_metadata, dist_wrapper: what planning returned.
        commit_cache: the record of the previous commit of the same saver (the strategy
            keeps one), which enables the warm path; without it every finalization
            gathers the write results.
        digest_history: the item digests of the saver's previous save, for the
            stale-checkpoint comparison; without it nothing is compared.

    Returns:
        On the coordinator, what changed since the previous save when the writer has a
        ``digest_history`` and the save stored items; None elsewhere (the reference API
        returns nothing).

    Raises:
        AsyncSaveFailedError: on every rank, when the write failed on any rank, the save
            is stale under ``fail_on_stale``, or the coordinator could not write the
            metadata. No ``.metadata`` is written then.
    """
    checkpoint = str(storage_writer.checkpoint_id)
    group = dist_wrapper.group
    rank = coordination.get_rank()
    is_coordinator = dist_wrapper.is_coordinator
    cache, history = commit_cache, digest_history

    results, failure = _local_results(storage_writer, rank)
    layout = storage_layout(results) if failure is None else None
    moved = (
        failure is not None
        or cache is None
        or not cache.matches(layout, global_metadata, is_coordinator)
    )
    comparison = (
        history.compare(checkpoint, digests_of(results))
        if history is not None and failure is None
        else ChangeReport(0, 0, None)
    )
    summed = coordination.agree(
        failure, coordination.save_failed(checkpoint), [int(moved), 1, *comparison.counts()], group
    )
    report = _judge_staleness(history, summed, comparison, checkpoint, dist_wrapper)

    start = time.monotonic()
    warm = not summed[_MOVED]
    if not warm:
        if cache is not None:
            cache.forget()
        all_results = coordination.gather_on_coordinator(results, dist_wrapper, "results")

    def commit() -> Optional[MetadataTemplate]:
        if warm:
            commit_unchanged(storage_writer.checkpoint_dir, cache.committed, storage_writer.storage_meta())
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
    if history is not None:
        history.accept()
    if cache is not None and not warm:
        cache.remember(layout, global_metadata, committed if is_coordinator else None)
    return report if is_coordinator else None


def _judge_staleness(
    history: Optional[SaveDigestHistory],
    summed: List[int],
    comparison: ChangeReport,
    checkpoint: str,
    dist_wrapper: _DistWrapper,
) -> Optional[ChangeReport]:
    """The job-wide comparison with the previous save, judged the same way on every rank.

    Raises:
        AsyncSaveFailedError: on every rank, a stale save under ``fail_on_stale``; it is
            recorded as the coordinator's failure, as that rank decides what is committed.
    """
    if history is None:
        return None
    report = ChangeReport.from_counts(
        summed[_RANKS + 1:], summed[_RANKS], comparison.previous_checkpoint
    )
    if report.items == 0:
        return None
    try:
        history.judge(checkpoint, report, warn=dist_wrapper.is_coordinator)
    except StaleCheckpointError as exc:
        coordinator = dist_wrapper.coordinator_rank
        if dist_wrapper.is_coordinator:
            logger.error("rank %d: %s", coordination.get_rank(), exc)
        failure = RankFailure.from_exception(coordinator, "finalize", exc)
        raise AsyncSaveFailedError({coordinator: failure}, checkpoint) from exc
    return report
