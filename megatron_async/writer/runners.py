"""Run one save's bucket writes in the background writer: threads or forked processes.

Runs in the background writer (a forked writer, or the persistent worker's write
thread). Every bucket's outcome, success or failure, lands in one
:class:`~.results.WriteOutcome`, published through a :class:`~.results.ResultFile`; a
failure is recorded, never raised, so that the trainer's finalization can turn it into
an error on every rank. Every wait is bounded by the writer's ``timeout_s``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import threading
import time
from typing import Any, Callable, List, Optional, Sequence

from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.core.process_lifetime import set_parent_death_signal
from megatron_async.errors import AsyncTimeoutError, RankFailure, WorkerDiedError
from megatron_async.writer.buckets import WriteBucket
from megatron_async.writer.results import ResultFile, WriteOutcome

__all__ = ["BucketWriter", "write_and_report", "write_with_threads", "write_with_processes"]

logger = logging.getLogger(__name__)

BucketWriter = Callable[[Any, WriteBucket, bool], List[WriteResult]]
"""``(transforms, bucket, use_fsync) -> results``: writes one staged bucket."""


def write_and_report(
    runner: Callable[[Sequence[WriteBucket], WriteOutcome], None],
    rank: int,
    write_buckets: Optional[Sequence[WriteBucket]],
    results_file: ResultFile,
) -> None:
    """Run ``runner`` on the staged buckets and publish the outcome (background writer).

    The staging buffers are not released here: the caller that staged them does that
    once the whole call is over (see :meth:`StagedBuckets.release`).
    """
    outcome = WriteOutcome(rank)
    try:
        if write_buckets is None:
            raise ValueError(
                "the save function got no staged buckets: the caller must run preload_fn and "
                "pass its result as args[1]"
            )
        runner(write_buckets, outcome)
    except Exception as exc:  # reported through the result file
        outcome.failures[-1] = RankFailure.from_exception(rank, "write", exc)
    results_file.put(outcome)


def write_with_threads(
    bucket_writer: BucketWriter,
    transforms: Any,
    use_fsync: bool,
    timeout_s: float,
    buckets: Sequence[WriteBucket],
    outcome: WriteOutcome,
) -> None:
    def run(idx: int, bucket: WriteBucket) -> None:
        try:
            outcome.results[idx] = bucket_writer(transforms, bucket, use_fsync)
        except Exception as exc:  # reported through the result file
            logger.error("rank %d: writing %s failed: %s", outcome.rank, bucket.file_name, exc)
            outcome.failures[idx] = RankFailure.from_exception(outcome.rank, "write", exc)

    threads = [
        threading.Thread(target=run, args=(idx, b), name=f"ckpt-write-{idx}", daemon=True)
        for idx, b in enumerate(buckets[:-1])
    ]
    for thread in threads:
        thread.start()
    if buckets:
        run(len(buckets) - 1, buckets[-1])
    deadline = time.monotonic() + timeout_s
    for idx, thread in enumerate(threads):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            outcome.failures[idx] = _timeout_failure(outcome.rank, buckets[idx], timeout_s)


def write_with_processes(
    bucket_writer: BucketWriter,
    transforms: Any,
    use_fsync: bool,
    timeout_s: float,
    results_file: ResultFile,
    buckets: Sequence[WriteBucket],
    outcome: WriteOutcome,
) -> None:
    rank = outcome.rank
    ctx = mp.get_context("fork")
    children = []
    for idx, bucket in enumerate(buckets):
        channel = results_file.derive(f"bucket{idx}")
        proc = ctx.Process(
            target=_bucket_process_main,
            args=(bucket_writer, transforms, bucket, use_fsync, rank, channel),
            name=f"ckpt-write-{idx}",
        )
        proc.start()
        children.append((idx, bucket, proc, channel))
    deadline = time.monotonic() + timeout_s
    for idx, bucket, proc, channel in children:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
            outcome.failures[idx] = _timeout_failure(rank, bucket, timeout_s)
            continue
        try:
            status, payload = channel.take()
        except (OSError, EOFError, pickle.UnpicklingError):
            exc = WorkerDiedError(
                f"rank {rank}: the process writing {bucket.file_name} exited with code "
                f"{proc.exitcode} without reporting a result"
            )
            status, payload = "error", RankFailure.from_exception(rank, "worker", exc)
        if status == "ok":
            outcome.results[idx] = payload
        else:
            outcome.failures[idx] = payload


def _timeout_failure(rank: int, bucket: WriteBucket, timeout_s: float) -> RankFailure:
    exc = AsyncTimeoutError(
        f"rank {rank}: writing {bucket.file_name} did not finish within {timeout_s:.0f}s; "
        "check the storage (a hung mount?) or raise write_timeout_s"
    )
    return RankFailure.from_exception(rank, "timeout", exc)


def _bucket_process_main(
    bucket_writer: BucketWriter,
    transforms: Any,
    bucket: WriteBucket,
    use_fsync: bool,
    rank: int,
    channel: ResultFile,
) -> None:
    """Entry point of one forked bucket-writing process (background side).

    Dies with its parent (the background writer): if that one is killed, nobody would
    read this process's result, and it must not go on writing into the checkpoint.
    """
    set_parent_death_signal()
    try:
        channel.put(("ok", bucket_writer(transforms, bucket, use_fsync)))
    except Exception as exc:  # reported through the channel
        channel.put(("error", RankFailure.from_exception(rank, "write", exc)))
