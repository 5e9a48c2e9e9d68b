"""FileSystemWriterAsync: a PyTorch DCP file writer whose writing runs in the background.

A save with this writer is split the way an :class:`~megatron_async.core.AsyncRequest`
needs it:

1. ``prepare_write_data`` (trainer, every rank): resolve the plan's data and split it into
   size-balanced buckets, one file each;
2. ``preload_fn`` (trainer before a forked writer, or the persistent worker): stage every
   tensor to host memory, a real snapshot (see :mod:`megatron_async._bucket_staging`);
3. ``save_fn`` (background writer): write the staged buckets with threads or processes
   and report the results through a :class:`~megatron_async._write_buckets.ResultFile`;
4. ``retrieve_write_results`` and ``finish`` (trainer, in the request's finalization):
   collect the results, and on the coordinator write ``.metadata`` atomically.

The files are PyTorch DCP's ``torch_save`` layout, so stock ``FileSystemReader``\\ s and
megatron-core's loader read them.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
from functools import partial
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_async._bucket_staging import stage_buckets
from megatron_async._write_buckets import (
    BucketLayout,
    ResultFile,
    WriteBucket,
    WriteOutcome,
    assign_buckets,
    materialize_buckets,
    write_bucket,
)
from megatron_async import checksums
from megatron_async._fs import fsync_path
from megatron_async.core import coordination
from megatron_async.core._process import set_parent_death_signal
from megatron_async.errors import (
    AsyncTimeoutError,
    CheckpointIntegrityError,
    CheckpointValidationError,
    RankFailure,
    StorageWriteError,
    WorkerDiedError,
)

__all__ = ["FileSystemWriterAsync", "DEFAULT_WRITE_TIMEOUT_S", "METADATA_FILE_NAME"]

logger = logging.getLogger(__name__)

DEFAULT_WRITE_TIMEOUT_S = 3600.0
"""How long the background writer waits for one save's bucket threads or processes."""

METADATA_FILE_NAME = ".metadata"

BucketWriter = Callable[[Any, WriteBucket, bool], List[WriteResult]]

_layout_lock = threading.Lock()
_layout_cache: Dict[str, BucketLayout] = {}


def _layout_key(plan: SavePlan, thread_count: int, separation_hint: Optional[str]) -> str:
    """A digest of everything that decides the bucket layout and the staging buffers' shapes."""
    digest = hashlib.sha1(repr((thread_count, separation_hint, plan.storage_data)).encode())
    for item in plan.items:
        tensor_data = item.tensor_data
        shape = (
            (tuple(tensor_data.chunk.sizes), str(tensor_data.properties.dtype))
            if tensor_data is not None
            else None
        )
        offset = tuple(item.index.offset) if item.index.offset is not None else None
        digest.update(repr((item.index.fqn, offset, item.type.value, shape)).encode())
    return digest.hexdigest()


def _check_storage_prefix(plan: SavePlan) -> None:
    if not isinstance(plan.storage_data, _StoragePrefix):
        raise CheckpointValidationError(
            "the plan has no storage prefix; finish planning (prepare_global_plan or "
            "prepare_decentralized_global_plan) before prepare_write_data"
        )


class FileSystemWriterAsync(FileSystemWriter):
    """DCP ``FileSystemWriter`` whose write step is handed to an external async caller.

    One writer serves one save: the state between planning and finalization lives in
    its attributes. Typical flow (every rank)::

        writer.prepare_write_data(central_plan, planner)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        # ... AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn) runs ...
        results = writer.retrieve_write_results()     # in finalization
        writer.finish(metadata, all_results)          # coordinator only

    Args:
        path: the checkpoint directory.
        *args: forwarded to ``FileSystemWriter`` (``single_file_per_rank`` must stay True).
        separation_hint: items whose key starts with it are written to separate files
            named ``{hint}__{rank}_{idx}.distcp``.
        is_multiproc_io: write buckets with forked processes instead of threads. The
            process running the save function must be allowed to have children (the
            persistent worker must not be daemonic).
        use_cached_data_structure: the checkpoint structure is the same from save to
            save: keep the bucket layout and the staging buffers (in the process that
            stages) instead of allocating them again.
        write_timeout_s: bound on the background writer's wait for its buckets.
        checksums: hash every item while writing it (xxh3) and store the digests in
            :data:`~megatron_async.checksums.CHECKSUM_FILE` before ``.metadata``.
        **kwargs: forwarded to ``FileSystemWriter`` (``thread_count``, ``sync_files``, ...).

    Raises:
        CheckpointValidationError: an unusable option.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *args: Any,
        separation_hint: Optional[str] = None,
        is_multiproc_io: bool = False,
        use_cached_data_structure: bool = False,
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        checksums: bool = True,
        **kwargs: Any,
    ):
        super().__init__(path, *args, **kwargs)
        if not self.single_file_per_rank:
            raise CheckpointValidationError(
                "FileSystemWriterAsync writes one file per bucket; pass single_file_per_rank=True"
            )
        if self.thread_count < 1:
            raise CheckpointValidationError(f"thread_count must be >= 1, got {self.thread_count}")
        if separation_hint is not None and (not separation_hint or os.sep in separation_hint):
            raise CheckpointValidationError(
                f"separation_hint {separation_hint!r} must be a non-empty key prefix without "
                f"{os.sep!r}: it becomes the start of file names"
            )
        self.checkpoint_dir = str(path)
        self.separation_hint = separation_hint
        self.is_multiproc_io = is_multiproc_io
        self.use_cached_data_structure = use_cached_data_structure
        self.write_timeout_s = float(write_timeout_s)
        self.checksums = bool(checksums)
        self.can_run_decentralized_global_plan = True

        self.write_buckets: Optional[List[WriteBucket]] = None
        self.results_file: Optional[ResultFile] = None
        self._staging_key: Optional[str] = None
        self._write_results: Optional[List[WriteResult]] = None

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Resolve the plan's data and split it into buckets (trainer, every rank).

        No data is copied here: staging happens in the request's ``preload_fn``.

        Args:
            plan: this rank's final plan; ``plan.storage_data`` holds the storage prefix.
            planner: the planner that resolves each write item to its data.
        """
        _check_storage_prefix(plan)
        resolved = [(item, planner.resolve_data(item)) for item in plan.items]
        self.prepare_resolved_write_data(plan, resolved)

    bucket_layout: Optional[BucketLayout] = None
    """The bucket layout of the prepared save (set by ``prepare_resolved_write_data``)."""

    @property
    def staging_key(self) -> Optional[str]:
        """The key of the prepared layout's reusable staging buffers, or None."""
        return self._staging_key

    def prepare_resolved_write_data(
        self,
        plan: SavePlan,
        resolved: Sequence[Tuple[WriteItem, Any]],
        layout: Optional[BucketLayout] = None,
        staging_key: Optional[str] = None,
    ) -> None:
        """Split already resolved items into buckets (trainer, every rank).

        A save whose structure did not change since the previous one resolves its items
        without a planner and passes the previous save's layout, which skips both the
        size balancing and the layout digest.

        Args:
            plan: this rank's final plan; ``plan.storage_data`` holds the storage prefix.
            resolved: ``(write_item, data)`` for every item of ``plan``, in plan order.
            layout: a bucket layout made for exactly these items (``bucket_layout`` of an
                earlier writer), or None to compute it.
            staging_key: with ``use_cached_data_structure``, the ``staging_key`` that
                ``layout`` had, or None to compute it.
        """
        _check_storage_prefix(plan)
        if self.use_cached_data_structure:
            if staging_key is None:
                staging_key = _layout_key(plan, self.thread_count, self.separation_hint)
            self._staging_key = staging_key
        if layout is None and self._staging_key is not None:
            with _layout_lock:
                layout = _layout_cache.get(self._staging_key)
        if layout is None:
            layout = assign_buckets(resolved, self.thread_count, self.separation_hint)
            if self._staging_key is not None:
                with _layout_lock:
                    _layout_cache.clear()  # one structure at a time: no growth across saves
                    _layout_cache[self._staging_key] = layout
        self.bucket_layout = layout
        self.write_buckets = materialize_buckets(
            resolved, layout, self.checkpoint_dir, plan.storage_data.prefix
        )
        self.results_file = (
            ResultFile.create(f"rank{coordination.get_rank()}") if self.write_buckets else None
        )
        self._write_results = None
        logger.debug(
            "rank %d: %d items in %d buckets for %s",
            coordination.get_rank(),
            len(resolved),
            len(self.write_buckets),
            self.checkpoint_dir,
        )

    def get_save_function_and_args(
        self,
    ) -> Tuple[Optional[Callable[..., None]], Optional[Callable[[], Any]], Optional[tuple]]:
        """Return ``(save_fn, preload_fn, args)``, or ``(None, None, None)`` with nothing to write.

        Runs in the trainer. Both functions are ``functools.partial`` objects of static
        methods, so they pickle to a spawned persistent worker. ``args`` is
        ``(rank, None, results_file)``: the caller replaces ``args[1]`` by the result of
        ``preload_fn`` (the staged buckets) before calling ``save_fn(*args)``.
        """
        if not self.write_buckets:
            return None, None, None
        write_fn = (
            self.write_preloaded_data_multiproc
            if self.is_multiproc_io
            else self.write_preloaded_data_multithread
        )
        bucket_writer = type(self).write_preloaded_data
        if not self.checksums:
            bucket_writer = partial(bucket_writer, compute_checksums=False)
        save_fn = partial(
            write_fn,
            self.transforms,
            self.sync_files,
            self.write_timeout_s,
            bucket_writer,
        )
        preload_fn = partial(self.preload_tensors, self.write_buckets, True, self._staging_key)
        return save_fn, preload_fn, (coordination.get_rank(), None, self.results_file)

    @staticmethod
    def preload_tensors(
        write_buckets: Sequence[WriteBucket],
        non_blocking: bool = True,
        staging_key: Optional[Hashable] = None,
    ) -> List[WriteBucket]:
        """Stage the buckets' tensors to host memory: a snapshot (preload side).

        CUDA tensors go to pinned buffers (non-blocking copies, one synchronize); CPU
        tensors are copied as well, so later in-place updates never reach the file.
        With ``staging_key``, this process's buffers of that layout are reused.
        """
        return stage_buckets(write_buckets, non_blocking, staging_key)

    @staticmethod
    def write_preloaded_data(
        transforms: Any, write_bucket_: WriteBucket, use_fsync: bool, compute_checksums: bool = True
    ) -> List[WriteResult]:
        """Write one staged bucket and return its results (a writer thread or process).

        Subclasses may override it (a fault-injecting writer in tests); it must stay a
        static method so that the save function still pickles.
        """
        return write_bucket(transforms, write_bucket_, use_fsync, compute_checksums)

    @staticmethod
    def write_preloaded_data_multithread(
        transforms: Any,
        use_fsync: bool,
        timeout_s: float,
        bucket_writer: BucketWriter,
        rank: int,
        write_buckets: Optional[Sequence[WriteBucket]],
        results_file: ResultFile,
    ) -> None:
        """Write the staged buckets, one thread each, and publish the outcome (background).

        The last bucket is written by the calling thread. A failed bucket is recorded in
        the outcome, not raised: the trainer's finalization turns it into an error on
        every rank.
        """
        runner = partial(_write_with_threads, bucket_writer, transforms, use_fsync, timeout_s)
        _write_and_report(runner, rank, write_buckets, results_file)

    @staticmethod
    def write_preloaded_data_multiproc(
        transforms: Any,
        use_fsync: bool,
        timeout_s: float,
        bucket_writer: BucketWriter,
        rank: int,
        write_buckets: Optional[Sequence[WriteBucket]],
        results_file: ResultFile,
    ) -> None:
        """Write the staged buckets, one forked process each, and publish the outcome.

        Runs in the background writer, which must be allowed to have children. Forked
        children share the staged buffers copy-on-write; each reports through its own
        result file, so a child that dies is detected (no result) instead of awaited.
        """
        runner = partial(
            _write_with_processes, bucket_writer, transforms, use_fsync, timeout_s, results_file
        )
        _write_and_report(runner, rank, write_buckets, results_file)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[WriteResult]]":
        """Write the plan synchronously (lets ``torch.distributed.checkpoint.save`` use this writer)."""
        self.prepare_write_data(plan, planner)
        save_fn, preload_fn, args = self.get_save_function_and_args()
        if save_fn is not None:
            staged = preload_fn()
            try:
                save_fn(args[0], staged, args[2])
            finally:
                staged.release()
        future: Future = Future()
        future.set_result(self.retrieve_write_results())
        return future

    def retrieve_write_results(self) -> List[WriteResult]:
        """Collect what the background writer reported (trainer, in finalization).

        Returns:
            The write results of every item of this rank (empty with nothing to write).

        Raises:
            WorkerDiedError: the writer reported nothing (it was killed or crashed).
            StorageWriteError: a bucket failed; ``failure`` holds the writer's traceback.
            CheckpointIntegrityError: a bucket reported no or too few results.
        """
        if self._write_results is not None:
            return self._write_results
        if self.write_buckets is None:
            raise CheckpointIntegrityError(
                f"no write was prepared for {self.checkpoint_dir}; call prepare_write_data first"
            )
        if not self.write_buckets:
            self._write_results = []
            return self._write_results
        rank = coordination.get_rank()
        try:
            outcome: WriteOutcome = self.results_file.take()
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            self.results_file.discard()
            raise WorkerDiedError(
                f"rank {rank}: the background writer of {self.checkpoint_dir} reported no "
                f"result ({exc}); it was probably killed (out of memory, signal) before "
                "finishing. The checkpoint is incomplete: save again."
            ) from exc
        if outcome.failures:
            failures = [outcome.failures[idx] for idx in sorted(outcome.failures)]
            summary = "; ".join(f.summary() for f in failures)
            raise StorageWriteError(
                f"rank {rank}: writing {self.checkpoint_dir} failed: {summary}", failures[0]
            )
        for idx, bucket in enumerate(self.write_buckets):
            expected = len(bucket.data[0]) + len(bucket.data[1])
            got = len(outcome.results.get(idx, ()))
            if got != expected:
                raise CheckpointIntegrityError(
                    f"rank {rank}: {bucket.file_name} in {self.checkpoint_dir} reported {got} of "
                    f"{expected} written items; its writer stopped early. Save again."
                )
        self._write_results = list(
            itertools.chain.from_iterable(outcome.results[i] for i in sorted(outcome.results))
        )
        return self._write_results

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """Give the plan the storage prefix ``__{rank}_`` without asking the coordinator.

        Runs on every rank; the result equals what ``prepare_global_plan`` assigns on the
        coordinator (plans are gathered in rank order).
        """
        return dataclasses.replace(
            local_plan, storage_data=_StoragePrefix(f"__{coordination.get_rank()}_")
        )

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Write ``.metadata`` atomically: temporary file, fsync, rename, fsync the directory.

        Runs on the coordinator only, after every rank's data is written. The caller's
        ``metadata`` object is not modified (it may be a cached one reused next save).
        """
        metadata = copy.copy(metadata)
        metadata.storage_data = {
            result.index: result.storage_data for rank_results in results for result in rank_results
        }
        metadata.storage_meta = self.storage_meta()
        if hasattr(metadata, "version"):
            from torch.distributed.checkpoint import filesystem as dcp_filesystem

            metadata.version = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", metadata.version)
        # megatron-core writes common.pt without an fsync; the checkpoint must not be marked
        # complete before it is durable too.
        common = os.path.join(self.checkpoint_dir, "common.pt")
        if os.path.exists(common):
            fsync_path(common)
        _record_checksums(self.checkpoint_dir, results)
        final_path = os.path.join(self.checkpoint_dir, METADATA_FILE_NAME)
        tmp_path = f"{final_path}.tmp"
        with open(tmp_path, "wb") as stream:
            pickle.dump(metadata, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp_path, final_path)
        fsync_path(self.checkpoint_dir, best_effort=True)


def _record_checksums(checkpoint_dir: str, results: List[List[WriteResult]]) -> None:
    """Write every rank's item digests, or drop a stale checksum file (coordinator).

    Runs before ``.metadata`` is written, so a checkpoint that looks complete always has
    the checksums of exactly its own items (or none at all). The records are built as the
    checksum file stores them, without an intermediate object per item: this runs on the
    training thread, with every rank's items.
    """
    records = []
    for rank_results in results:
        for result in rank_results:
            digest = getattr(result, "checksum", None)
            if digest is None:
                continue
            storage, index = result.storage_data, result.index
            records.append(
                {
                    "file": storage.relative_path,
                    "offset": storage.offset,
                    "length": storage.length,
                    "digest": digest,
                    "fqn": index.fqn,
                    "chunk_offsets": None if index.offset is None else list(index.offset),
                }
            )
    if records:
        checksums.write_checksum_records(checkpoint_dir, records)
    else:
        try:
            os.remove(os.path.join(checkpoint_dir, checksums.CHECKSUM_FILE))
        except FileNotFoundError:
            pass


def _write_and_report(
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


def _write_with_threads(
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


def _write_with_processes(
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
