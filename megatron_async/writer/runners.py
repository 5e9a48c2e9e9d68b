"""Run one save's bucket writes in the background writer, one thread per bucket.

Runs in the background writer (a forked writer, or the persistent worker's write
thread). Every bucket's outcome, success or failure, lands in one
:class:`~.results.WriteOutcome`, whose :meth:`~.results.WriteOutcome.payload` goes to the
save's results channel; a failure is recorded, never raised, so that the trainer's
finalization can turn it into an error on every rank. Every wait is bounded by the
writer's ``timeout_s``.

Threads, not a forked process per bucket as megatron-core's ``_multiproc`` path does:
the writes and the hashing release the GIL, and the forked children gained nothing
that was measured, so ``is_multiproc_io`` writes on threads too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, List, Optional, Sequence

from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.integrity import checksums
from megatron_async.errors import AsyncTimeoutError, RankFailure
from megatron_async.buckets.layout import WriteBucket
from megatron_async.writer.results import WriteOutcome

__all__ = ["BucketWriter", "write_and_report", "write_with_threads"]

logger = logging.getLogger(__name__)

BucketWriter = Callable[[int, WriteBucket], List[WriteResult]]
"""``(bucket_index, bucket) -> results``: writes one staged bucket, raises on failure."""


def write_and_report(
    runner: Callable[[Sequence[WriteBucket], WriteOutcome], None],
    rank: int,
    write_buckets: Optional[Sequence[WriteBucket]],
    results_channel: Any,
) -> None:
    """Run ``runner`` on the staged buckets, record their checksums, and put the outcome
    into ``results_channel``.

    Runs in the background writer. ``results_channel`` is anything with ``put``: the
    writer's :class:`ResultFile`, or a queue from ``get_write_results_queue``. The staging
    buffers are not released here: the caller that staged them does that once the whole
    call is over (see :meth:`StagedBuckets.release`).
    """
    directory = os.path.dirname(write_buckets[0].file_path) if write_buckets else ""
    outcome = WriteOutcome(rank, checkpoint_dir=directory)
    start = time.monotonic()
    try:
        if write_buckets is None:
            raise ValueError(
                "the save function got no staged buckets: the caller must run preload_fn and "
                "pass its result as args[1]"
            )
        runner(write_buckets, outcome)
        if not outcome.failures:
            # The data files are durable: record their checksums before reporting done.
            checksums.write_rank_record(
                directory, rank, (r for idx in sorted(outcome.results) for r in outcome.results[idx])
            )
    except Exception as exc:  # reported through the results channel
        outcome.failures[-1] = RankFailure.from_exception(rank, "write", exc)
    outcome.elapsed_s = time.monotonic() - start
    logger.debug(
        "rank %d: background write of %s took %.3fs (%d buckets, %d failed)",
        rank, directory, outcome.elapsed_s, len(write_buckets or ()), len(outcome.failures),
    )
    results_channel.put(outcome.payload())


def write_with_threads(
    write_one: BucketWriter,
    timeout_s: float,
    buckets: Sequence[WriteBucket],
    outcome: WriteOutcome,
) -> None:
    """Write each bucket on its own thread, the last one on the calling thread; the
    others must be done within ``timeout_s`` of the start (the calling thread's own bucket
    is bounded by the caller's timeout, which ends this whole process)."""

    def run(idx: int, bucket: WriteBucket) -> None:
        try:
            outcome.results[idx] = write_one(idx, bucket)
        except Exception as exc:  # reported through the results channel
            logger.error("rank %d: writing %s failed: %s", outcome.rank, bucket.file_name, exc)
            outcome.failures[idx] = RankFailure.from_exception(outcome.rank, "write", exc)

    threads = [
        threading.Thread(target=run, args=(idx, b), name=f"ckpt-write-{idx}", daemon=True)
        for idx, b in enumerate(buckets[:-1])
    ]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    if buckets:
        run(len(buckets) - 1, buckets[-1])
    for idx, thread in enumerate(threads):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            outcome.failures[idx] = _timeout_failure(outcome.rank, buckets[idx], timeout_s)


def _timeout_failure(rank: int, bucket: WriteBucket, timeout_s: float) -> RankFailure:
    exc = AsyncTimeoutError(
        f"rank {rank}: writing {bucket.file_name} did not finish within {timeout_s:.0f}s; "
        "check the storage (a hung mount?) or raise write_timeout_s"
    )
    return RankFailure.from_exception(rank, "timeout", exc)
