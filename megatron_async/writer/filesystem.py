"""FileSystemWriterAsync: a PyTorch DCP file writer whose writing runs in the background.

A save with this writer is split the way an :class:`~megatron_async.core.AsyncRequest`
needs it:

1. ``prepare_write_data`` (trainer, every rank): resolve the plan's data and split it into
   size-balanced buckets, one file each;
2. ``preload_fn`` (trainer before a forked writer, or the persistent worker): stage every
   tensor to host memory, a real snapshot (see :mod:`megatron_async.staging.buckets`);
3. ``save_fn`` (background writer): write the staged buckets with threads or processes
   and report the results through a :class:`~megatron_async.writer.buckets.ResultFile`;
4. ``retrieve_write_results`` and ``finish`` (trainer, in the request's finalization):
   collect the results, and on the coordinator write ``.metadata`` atomically.

The files are PyTorch DCP's ``torch_save`` layout, so stock ``FileSystemReader``\\ s and
megatron-core's loader read them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import pickle
from functools import partial
from typing import Any, Callable, Hashable, List, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_async.core import coordination
from megatron_async.errors import (
    CheckpointIntegrityError,
    CheckpointValidationError,
    StorageWriteError,
    WorkerDiedError,
)
from megatron_async.format import DCP_METADATA_FILE
from megatron_async.staging.buckets import StagingBufferCache, stage_buckets
from megatron_async.storage.client import MSC_EXTRA_HINT, import_msc
from megatron_async.storage.locations import (
    DEFAULT_PART_BYTES,
    MIN_PART_BYTES,
    is_object_url,
    normalize_checkpoint_path,
)
from megatron_async.writer.bucket_io import BucketFile, OpenBucketFile, write_bucket
from megatron_async.writer.buckets import BucketLayout, WriteBucket, assign_buckets, materialize_buckets
from megatron_async.writer.commit import commit_checkpoint
from megatron_async.writer.results import ResultFile, WriteOutcome
from megatron_async.writer.runners import (
    BucketWriter,
    write_and_report,
    write_with_processes,
    write_with_threads,
)

__all__ = ["FileSystemWriterAsync", "DEFAULT_WRITE_TIMEOUT_S", "METADATA_FILE_NAME"]

logger = logging.getLogger(__name__)

DEFAULT_WRITE_TIMEOUT_S = 3600.0
"""How long the background writer waits for one save's bucket threads or processes."""

METADATA_FILE_NAME = DCP_METADATA_FILE
"""DCP's global metadata file (kept under this name for older imports)."""


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
            save: reuse the staging buffers of the previous save of the same layout
            instead of allocating them again.
        staging_cache: where those buffers are kept (the trainer's); the process's
            :func:`~megatron_async.staging.buckets.default_staging_cache` when None.
        write_timeout_s: bound on the background writer's wait for its buckets.
        checksums: hash every item while writing it (xxh3) and store the digests in
            :data:`~megatron_async.integrity.checksums.CHECKSUM_FILE` before ``.metadata``.
        use_msc: ``path`` is an ``msc://PROFILE/PREFIX`` URL of multi-storage-client:
            every bucket is streamed to the store as it is written (multipart uploads of
            ``object_part_bytes``), and the small files are single PUTs, ``.metadata``
            last (see :mod:`megatron_async.storage`). Needs the ``msc`` extra.
        object_part_bytes: with ``use_msc``, bytes per uploaded part (at least 5 MiB):
            about the memory each bucket's upload holds.
        overlap_staging: ``preload_fn`` only leases the staging buffers; the copy runs in
            a background thread of the trainer while training goes on, and ``save_fn``
            waits for it (see :mod:`megatron_async.staging.overlapped`).
        **kwargs: forwarded to ``FileSystemWriter`` (``thread_count``, ``sync_files``, ...).

    Raises:
        CheckpointValidationError: an unusable option, or an ``msc://`` path without
            ``use_msc``.
        ObjectStoreUnavailableError: ``use_msc`` without multi-storage-client installed.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *args: Any,
        separation_hint: Optional[str] = None,
        use_msc: bool = False,
        is_multiproc_io: bool = False,
        use_cached_data_structure: bool = False,
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        checksums: bool = True,
        staging_cache: Optional[StagingBufferCache] = None,
        object_part_bytes: int = DEFAULT_PART_BYTES,
        overlap_staging: bool = False,
        **kwargs: Any,
    ):
        if use_msc:
            import_msc()  # a clear error naming the extra before anything else
        elif is_object_url(path):
            raise CheckpointValidationError(
                f"{os.fspath(path)} is an object-storage URL; pass use_msc=True (and install "
                f"the extra: {MSC_EXTRA_HINT})"
            )
        if use_msc and object_part_bytes < MIN_PART_BYTES:
            raise CheckpointValidationError(
                f"object_part_bytes must be >= {MIN_PART_BYTES} (S3's smallest part), got "
                f"{object_part_bytes}"
            )
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
        self.checkpoint_dir = normalize_checkpoint_path(path) if use_msc else str(path)
        self.use_msc = bool(use_msc)
        self.object_part_bytes = int(object_part_bytes)
        if self.use_msc:
            from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystem

            # DCP's own planning steps (mkdir, existing-checkpoint check) go through MSC.
            self.fs = MultiStorageFileSystem()
            try:
                self.path = self.fs.init_path(self.checkpoint_dir)
            except ValueError as exc:  # an unknown profile, a malformed URL
                raise CheckpointValidationError(
                    f"{self.checkpoint_dir}: multi-storage-client cannot resolve it ({exc}); "
                    "define the profile in MSC's configuration (MSC_CONFIG or ~/.msc_config.yaml)"
                ) from exc
        self.separation_hint = separation_hint
        self.is_multiproc_io = is_multiproc_io
        self.use_cached_data_structure = use_cached_data_structure
        self.write_timeout_s = float(write_timeout_s)
        self.checksums = bool(checksums)
        self.staging_cache = staging_cache
        self.overlap_staging = bool(overlap_staging)
        self.can_run_decentralized_global_plan = True

        self.write_buckets: Optional[List[WriteBucket]] = None
        self.results_file: Optional[ResultFile] = None
        self._staging_key: Optional[str] = None
        self._write_results: Optional[List[WriteResult]] = None

    def storage_meta(self):
        """DCP's storage metadata; with ``use_msc`` its ``checkpoint_id`` is the URL string,
        so that ``.metadata`` unpickles without multi-storage-client."""
        meta = super().storage_meta()
        if self.use_msc and meta is not None:
            meta = dataclasses.replace(meta, checkpoint_id=self.checkpoint_dir)
        return meta

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
        if layout is None:  # deterministic: the same items give the same layout (and buffers)
            layout = assign_buckets(resolved, self.thread_count, self.separation_hint)
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
        methods, so they pickle to the persistent worker. ``args`` is
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
        if self.use_msc:
            from megatron_async.storage.stream import object_bucket_opener

            bucket_writer = partial(
                bucket_writer, open_bucket_file=object_bucket_opener(self.object_part_bytes)
            )
        save_fn = partial(
            write_fn,
            self.transforms,
            self.sync_files,
            self.write_timeout_s,
            bucket_writer,
        )
        if self.overlap_staging:
            return self._overlapped_functions(save_fn)
        preload_fn = partial(
            self.preload_tensors,
            self.write_buckets,
            True,
            self._staging_key,
            staging_cache=self.staging_cache,
        )
        return save_fn, preload_fn, (coordination.get_rank(), None, self.results_file)

    def _overlapped_functions(self, save_fn):
        """``(save_fn, preload_fn, args)`` of overlapped staging: ``preload_fn`` leases the
        buffers, a trainer thread copies, and ``save_fn`` waits for the copy first."""
        from megatron_async.staging.overlapped import (
            DEFAULT_STAGING_WAIT_S,
            StagingGate,
            stage_buckets_overlapped,
            write_after_staging,
        )

        gate = StagingGate()
        rank = coordination.get_rank()
        preload_fn = partial(
            stage_buckets_overlapped, gate, rank, self.write_buckets, True, self._staging_key,
            self.staging_cache,
        )
        save_fn = partial(write_after_staging, gate, DEFAULT_STAGING_WAIT_S, save_fn)
        return save_fn, preload_fn, (rank, None, self.results_file)

    @staticmethod
    def preload_tensors(
        write_buckets: Sequence[WriteBucket],
        non_blocking: bool = True,
        staging_key: Optional[Hashable] = None,
        staging_cache: Optional[StagingBufferCache] = None,
    ) -> List[WriteBucket]:
        """Stage the buckets' tensors to host memory: a snapshot (trainer, every rank).

        CUDA tensors go to pinned buffers (non-blocking copies, one synchronize); CPU
        tensors are copied as well, so later in-place updates never reach the file.
        With ``staging_key``, the buffers of that layout in ``staging_cache`` are reused.
        """
        return stage_buckets(write_buckets, non_blocking, staging_key, staging_cache)

    @staticmethod
    def write_preloaded_data(
        transforms: Any,
        write_bucket_: WriteBucket,
        use_fsync: bool,
        compute_checksums: bool = True,
        open_bucket_file: OpenBucketFile = BucketFile,
    ) -> List[WriteResult]:
        """Write one staged bucket and return its results (a writer thread or process).

        Subclasses may override it (a fault-injecting writer in tests); it must stay a
        static method so that the save function still pickles. ``open_bucket_file`` is
        passed only for object storage (``use_msc``).
        """
        return write_bucket(transforms, write_bucket_, use_fsync, compute_checksums, open_bucket_file)

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
        runner = partial(write_with_threads, bucket_writer, transforms, use_fsync, timeout_s)
        write_and_report(runner, rank, write_buckets, results_file)

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
            write_with_processes, bucket_writer, transforms, use_fsync, timeout_s, results_file
        )
        write_and_report(runner, rank, write_buckets, results_file)

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

        The messages of the errors from the background writer keep megatron-core's
        wording ("Worker failure: ...", "... This probably indicates a worker failure."),
        which log alerts and Megatron-LM's tests search for.
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
                f"Worker failure on rank {rank}: the background writer of "
                f"{self.checkpoint_dir} reported no result ({exc}); it was probably killed "
                "(out of memory, signal) before finishing. The checkpoint is incomplete: "
                "save again."
            ) from exc
        if outcome.failures:
            failures = [outcome.failures[idx] for idx in sorted(outcome.failures)]
            causes = "; ".join(f"[{f.phase}] {f.exception_type}: {f.message}" for f in failures)
            raise StorageWriteError(
                f"Worker failure on rank {rank}: writing {self.checkpoint_dir} failed: {causes}",
                failures[0],
            )
        for idx, bucket in enumerate(self.write_buckets):
            expected = len(bucket.data[0]) + len(bucket.data[1])
            got = len(outcome.results.get(idx, ()))
            if got != expected:
                raise CheckpointIntegrityError(
                    f"rank {rank}: {bucket.file_name} in {self.checkpoint_dir} reported {got} of "
                    f"{expected} written items; its writer stopped early. This probably "
                    "indicates a worker failure. Save again."
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
        """Write the checksums and ``.metadata`` atomically (coordinator only).

        Runs after every rank's data is written; see
        :func:`megatron_async.writer.commit.commit_checkpoint`.
        """
        commit_checkpoint(self.checkpoint_dir, metadata, results, self.storage_meta())
