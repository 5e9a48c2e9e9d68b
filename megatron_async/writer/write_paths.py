"""The reference API's write paths: how the background writer writes a save's staged buckets.

Runs in the background writer: a forked writer or the persistent worker's write thread.
:class:`~megatron_async.writer.filesystem.FileSystemWriterAsync` keeps these functions as
the static methods that megatron-core and nvidia-resiliency-ext name, and that subclasses
override. One bucket's bytes are written by :func:`~.bucket_io.write_bucket`.

Each bucket's outcome, success or failure, lands in one :class:`~.results.WriteOutcome`,
whose payload goes to the save's results channel: a failure is recorded, never raised,
so that the trainer's finalization turns it into an error on every rank. Buckets are
written on threads, not in a forked process each as megatron-core's ``_multiproc`` path
does: the writes and the hashing release the GIL, and forked children gained nothing
that was measured, so ``is_multiproc_io`` writes on threads too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.buckets.layout import WriteBucket
from megatron_async.errors import (
    AsyncTimeoutError, CheckpointIntegrityError, CheckpointValidationError, RankFailure,
)
from megatron_async.integrity import checksums
from megatron_async.writer.bucket_io import write_bucket as write_bucket_file
from megatron_async.writer.options import DEFAULT_WRITE_TIMEOUT_S
from megatron_async.writer.results import WriteOutcome

__all__ = [
    "write_preloaded_data",
    "write_preloaded_data_proc",
    "write_preloaded_data_multithread",
    "write_preloaded_data_multiproc",
]

logger = logging.getLogger(__name__)


def write_preloaded_data(
    transform_list: Any,
    open_file: Callable[..., Any],
    local_thread_idx: int,
    write_bucket: WriteBucket,
    results_queue: Any,
    count_queue: Any,
    use_fsync: bool,
    **kwargs: Any,
) -> Optional[Tuple[int, Union[List[WriteResult], Exception]]]:
    """Write one staged bucket (a writer thread, or the calling thread).

    This is ``FileSystemWriterAsync.write_preloaded_data``; the write paths call
    ``type(writer).write_preloaded_data``, so a subclass's override is the one used.

    Args:
        transform_list: the writer's stream transforms (DCP extensions).
        open_file: opens the file (see :func:`~.bucket_io.write_bucket`).
        local_thread_idx: index of the bucket among this save's buckets.
        write_bucket: the staged bucket.
        results_queue: where the output goes, or None to return it.
        count_queue: a joinable queue whose ``get`` / ``task_done`` marks this worker
            done, or None.
        use_fsync: make the file durable before returning.
        **kwargs: ``compute_checksums`` (default True), ``use_msc`` (default False)
            and ``direct_io`` (default True; see :func:`~.bucket_io.write_bucket`).

    Returns:
        ``(local_thread_idx, results or the exception raised)`` when ``results_queue``
        is None, else None.
    """
    try:
        if kwargs.get("use_msc", False) and (open_file is None or open_file is open):
            raise CheckpointValidationError(
                "use_msc=True needs an object-store open_file (for example multistorageclient's "
                "msc.open), got the local file system's open; pass use_msc=False for local and "
                "shared file systems, or the object store's open callable"
            )
        results = write_bucket_file(
            transform_list,
            write_bucket,
            use_fsync,
            kwargs.get("compute_checksums", True),
            open_file=open_file,
            direct_io=kwargs.get("direct_io", True),
        )
        output: Tuple[int, Union[List[WriteResult], Exception]] = (local_thread_idx, results)
    except Exception as exc:  # returned or queued, as the reference API specifies
        output = (local_thread_idx, exc)
    if results_queue is None:
        return output
    results_queue.put(output)
    if count_queue is not None:
        count_queue.get()
        count_queue.task_done()
    return None


write_preloaded_data_proc = write_preloaded_data
"""The reference API's target for a writer process it starts itself (``results_queue``
given): the same function."""


def write_preloaded_data_multithread(
    transform_list: Any,
    use_msc: bool,
    open_file: Callable[..., Any],
    rank: int,
    write_buckets: Optional[Sequence[WriteBucket]],
    global_results_queue: Any,
    *,
    use_fsync: bool = True,
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
    bucket_writer: Optional[Callable[..., Any]] = None,
    compute_checksums: bool = True,
    direct_io: bool = True,
    staging_control: Any = None,
) -> None:
    """Write the staged buckets, one thread each, and report the outcome (background).

    Once every bucket is written, this rank's checksum record is written, then the
    outcome is reported. The staging buffers are not released here: the caller that
    staged them does that once the whole call is over.

    Args:
        transform_list, use_msc, open_file: see :func:`write_preloaded_data`.
        rank: the training rank (for messages).
        write_buckets: the staged buckets (``preload_fn``'s result).
        global_results_queue: the writer's results file, or anything with ``put``; it
            gets a dict bucket index -> write results, or the
            :class:`~megatron_async.errors.StorageWriteError` that says what failed.
        use_fsync: make every file durable.
        write_timeout_s: bound on the wait for the writer threads.
        bucket_writer: writes one bucket; ``write_preloaded_data`` when None.
        compute_checksums: hash every item while writing it.
        direct_io: write local files with ``O_DIRECT`` where accepted.
        staging_control: the save's staging gate
            (:class:`~megatron_async.staging.gate.StagingGate`): items may arrive after
            the hand-over, and the gate is marked done at the end, which frees the save's
            staging memory.
    """
    options = {"use_msc": use_msc, "compute_checksums": compute_checksums}
    if not direct_io:  # only when off: overrides then get the reference API's keywords
        options["direct_io"] = False
    write_one_bucket = bucket_writer or write_preloaded_data

    def write_one(idx: int, bucket: WriteBucket) -> List[WriteResult]:
        output = write_one_bucket(
            transform_list, open_file, idx, bucket, None, None, use_fsync, **options
        )
        if output is None:
            raise CheckpointIntegrityError(
                f"write_preloaded_data returned nothing for {bucket.file_name} although no "
                "results_queue was given; an override must return (index, results or exception)"
            )
        if isinstance(output[1], BaseException):
            raise output[1]
        return output[1]

    directory = os.path.dirname(write_buckets[0].file_path) if write_buckets else ""
    outcome = WriteOutcome(rank, checkpoint_dir=directory)
    start = time.monotonic()
    try:
        try:
            if staging_control is not None:
                write_buckets = staging_control.writer_view(write_buckets, write_timeout_s)
            if write_buckets is None:
                raise ValueError(
                    "the save function got no staged buckets: the caller must run preload_fn "
                    "and pass its result as args[1]"
                )
            write_with_threads(write_one, write_timeout_s, write_buckets, outcome)
            if not outcome.failures:
                # The data files are durable: record their checksums before reporting done.
                checksums.write_rank_record(
                    directory, rank,
                    (r for idx in sorted(outcome.results) for r in outcome.results[idx]),
                )
        except Exception as exc:  # reported through the results channel
            outcome.failures[-1] = RankFailure.from_exception(rank, "write", exc)
        outcome.elapsed_s = time.monotonic() - start
        logger.debug(
            "rank %d: background write of %s took %.3fs (%d buckets, %d failed)",
            rank, directory, outcome.elapsed_s, len(write_buckets or ()), len(outcome.failures),
        )
        global_results_queue.put(outcome.payload())
    finally:
        if staging_control is not None:
            staging_control.mark_done()


write_preloaded_data_multiproc = write_preloaded_data_multithread
"""The reference API's process path (``is_multiproc_io``): the same threads."""


def write_with_threads(
    write_one: Callable[[int, WriteBucket], List[WriteResult]],
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
            exc = AsyncTimeoutError(
                f"rank {outcome.rank}: writing {buckets[idx].file_name} did not finish within "
                f"{timeout_s:.0f}s; check the storage (a hung mount?) or raise write_timeout_s"
            )
            outcome.failures[idx] = RankFailure.from_exception(outcome.rank, "timeout", exc)
