"""Commit an asynchronous save once its background write is done (every rank).

The last of a save's three steps (plan, write, finalize; see
:mod:`megatron_async.saver.state_dict_saver`): every rank reports whether its write
succeeded, and only if all did does the coordinator write ``.metadata``. A failure
anywhere raises the same error on every rank.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, List, Optional

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron_async.core import coordination
from megatron_async.errors import CheckpointValidationError, RankFailure

if TYPE_CHECKING:
    from megatron_async.writer.filesystem import FileSystemWriterAsync

__all__ = ["save_state_dict_async_finalize"]

logger = logging.getLogger(__name__)


def _is_wrapped_exception(results: Any) -> bool:
    """Whether ``results`` is DCP's ``(exception, traceback)`` instead of write results."""
    return isinstance(results, tuple) and len(results) == 2 and isinstance(results[0], BaseException)


def save_state_dict_async_finalize(
    storage_writer: "FileSystemWriterAsync",
    global_metadata: Optional[Metadata],
    dist_wrapper: _DistWrapper,
) -> None:
    """Commit the save once the background write is done on every rank (every rank).

    Every rank reports whether its write succeeded; only if all did does the coordinator
    gather the write results and write ``.metadata`` (atomically). Costs two all-reduces
    and one gather on the coordination group.

    Raises:
        AsyncSaveFailedError: on every rank, when the write failed on any rank or the
            coordinator could not write the metadata. No ``.metadata`` is written then.
    """
    checkpoint = str(storage_writer.checkpoint_id)
    group = dist_wrapper.group
    rank = coordination.get_rank()
    results: List[Any] = []
    failure: Optional[RankFailure] = None
    try:
        results = storage_writer.retrieve_write_results()
        if _is_wrapped_exception(results):  # the reference API returns background failures
            raise results[0]
    except Exception as exc:  # reported on every rank below
        logger.error("rank %d: background write of %s failed: %s", rank, checkpoint, exc)
        failure = getattr(exc, "failure", None) or RankFailure.from_exception(rank, "write", exc)
        results = []
    coordination.raise_if_any_rank_failed(failure, group, checkpoint)

    start = time.monotonic()
    all_results = dist_wrapper.gather_object(results)
    logger.debug("rank %d: gathered the write results of %s in %.3fs", rank, checkpoint, time.monotonic() - start)
    if dist_wrapper.is_coordinator:
        try:
            if global_metadata is None:
                raise CheckpointValidationError(
                    f"the coordinator has no metadata for {checkpoint}; the plan cache was lost"
                )
            start = time.monotonic()
            storage_writer.finish(global_metadata, all_results)
            logger.debug(
                "rank %d: wrote the metadata of %s in %.3fs", rank, checkpoint, time.monotonic() - start
            )
        except Exception as exc:
            logger.error("rank %d: writing the metadata of %s failed: %s", rank, checkpoint, exc)
            failure = RankFailure.from_exception(rank, "finalize", exc)
    coordination.raise_if_any_rank_failed(failure, group, checkpoint)
