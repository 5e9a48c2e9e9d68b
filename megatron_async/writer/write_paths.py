"""The reference API's write paths: how a process writes its staged buckets.

Runs in the background writer: a forked writer or the persistent worker. :class:`~megatron_async.writer.filesystem.FileSystemWriterAsync`
keeps the static methods that megatron-core and nvidia-resiliency-ext name, and that
subclasses override: ``write_preloaded_data``, ``write_preloaded_data_proc``,
``write_preloaded_data_multithread`` and ``write_preloaded_data_multiproc`` are the
functions of this module (the last one is the same function as the one before). One
bucket's bytes are written by :func:`~.bucket_io.write_bucket`; the threads are run by
:mod:`.runners`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.errors import CheckpointIntegrityError, CheckpointValidationError
from megatron_async.writer.bucket_io import write_bucket as write_bucket_file
from megatron_async.buckets.layout import WriteBucket
from megatron_async.writer.options import DEFAULT_WRITE_TIMEOUT_S
from megatron_async.writer.runners import write_and_report, write_with_threads

__all__ = [
    "SpecBucketWriter",
    "write_preloaded_data",
    "write_preloaded_data_proc",
    "write_preloaded_data_multithread",
    "write_preloaded_data_multiproc",
]

SpecBucketWriter = Callable[..., Optional[Tuple[int, Union[List[WriteResult], Exception]]]]
"""``write_preloaded_data``'s signature (see :func:`write_preloaded_data`)."""


def _check_opener(use_msc: bool, open_file: Optional[Callable[..., Any]]) -> None:
    """Refuse ``use_msc`` without an object-store ``open_file`` (background writer)."""
    if use_msc and (open_file is None or open_file is open):
        raise CheckpointValidationError(
            "use_msc=True needs an object-store open_file (for example multistorageclient's "
            "msc.open), got the local file system's open; pass use_msc=False for local and "
            "shared file systems, or the object store's open callable"
        )


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

    This is ``FileSystemWriterAsync.write_preloaded_data``. Subclasses may override it
    (a fault-injecting writer in tests): the write paths call
    ``type(writer).write_preloaded_data``. It must stay a static method so that the save
    function still pickles.

    Args:
        transform_list: the writer's stream transforms (DCP extensions).
        open_file: opens the file; the built-in ``open`` writes with direct system
            calls, any other callable (an object store's ``open``) is used as is.
        local_thread_idx: index of the bucket among this save's buckets.
        write_bucket: the staged bucket.
        results_queue: where ``(local_thread_idx, results or exception)`` goes; None
            returns it instead.
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
        _check_opener(kwargs.get("use_msc", False), open_file)
        output: Tuple[int, Union[List[WriteResult], Exception]] = (
            local_thread_idx,
            write_bucket_file(
                transform_list,
                write_bucket,
                use_fsync,
                kwargs.get("compute_checksums", True),
                open_file=open_file,
                direct_io=kwargs.get("direct_io", True),
            ),
        )
    except Exception as exc:  # returned or queued, as the reference API specifies
        output = (local_thread_idx, exc)
    if results_queue is None:
        return output
    results_queue.put(output)
    if count_queue is not None:
        count_queue.get()
        count_queue.task_done()
    return None


def write_preloaded_data_proc(
    transform_list: Any,
    open_file: Callable[..., Any],
    local_proc_idx: int,
    write_bucket: WriteBucket,
    results_queue: Any,
    count_queue: Any,
    use_fsync: bool,
    **kwargs: Any,
) -> None:
    """Write one staged bucket in a worker process and queue its outcome.

    This is ``FileSystemWriterAsync.write_preloaded_data_proc``: the same as
    :func:`write_preloaded_data` with a ``results_queue``, for code that starts its own
    writer processes with it as target.

    Raises:
        CheckpointValidationError: ``results_queue`` is None (the outcome would be lost).
    """
    if results_queue is None:
        raise CheckpointValidationError(
            "write_preloaded_data_proc reports through results_queue; pass a queue "
            "(or call write_preloaded_data, which returns the outcome without one)"
        )
    write_preloaded_data(
        transform_list, open_file, local_proc_idx, write_bucket, results_queue,
        count_queue, use_fsync, **kwargs,
    )


def _write_one_bucket(
    bucket_writer: SpecBucketWriter,
    transform_list: Any,
    open_file: Callable[..., Any],
    use_fsync: bool,
    options: Dict[str, Any],
    idx: int,
    bucket: WriteBucket,
) -> List[WriteResult]:
    """Write one bucket through ``write_preloaded_data`` and raise what it returns as failed."""
    output = bucket_writer(transform_list, open_file, idx, bucket, None, None, use_fsync, **options)
    if output is None:
        raise CheckpointIntegrityError(
            f"write_preloaded_data returned nothing for {bucket.file_name} although no "
            "results_queue was given; an override must return (index, results or exception)"
        )
    result = output[1]
    if isinstance(result, BaseException):
        raise result
    return result


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
    bucket_writer: Optional[SpecBucketWriter] = None,
    compute_checksums: bool = True,
    direct_io: bool = True,
    staging_control: Any = None,
) -> None:
    """Write the staged buckets, one thread each, and report the outcome (background).

    The last bucket is written by the calling thread. A failed bucket is recorded in
    the outcome, not raised: the trainer's finalization turns it into an error on
    every rank. What goes to ``global_results_queue`` (the writer's results file, or
    any object with ``put``, e.g. :func:`~.results.get_write_results_queue`) is a dict bucket
    index -> write results, or the :class:`~megatron_async.errors.StorageWriteError`
    that says what failed. The positional arguments are a save function's ``args``, the
    keywords what the writer names and staging binds
    (:func:`~megatron_async.staging.stager.prepare_staged_write`).

    Args:
        transform_list, use_msc, open_file: see :func:`write_preloaded_data`.
        rank: the training rank (for messages).
        write_buckets: the staged buckets (``preload_fn``'s result).
        global_results_queue: where the outcome goes.
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
    write_one = partial(
        _write_one_bucket, bucket_writer or write_preloaded_data, transform_list, open_file,
        use_fsync, options,
    )
    runner = partial(write_with_threads, write_one, write_timeout_s)
    if staging_control is None:
        write_and_report(runner, rank, write_buckets, global_results_queue)
        return
    try:
        write_buckets = staging_control.writer_view(write_buckets, write_timeout_s)
        write_and_report(runner, rank, write_buckets, global_results_queue)
    finally:
        staging_control.mark_done()


write_preloaded_data_multiproc = write_preloaded_data_multithread
"""The reference API's process path (``is_multiproc_io``): the same threads (see
:mod:`.runners` for why no process per bucket)."""
