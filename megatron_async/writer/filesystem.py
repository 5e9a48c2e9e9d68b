"""FileSystemWriterAsync: a PyTorch DCP file writer whose writing runs in the background.

A save with this writer is split the way an :class:`~megatron_async.core.AsyncRequest`
needs it:

1. ``prepare_write_data`` (trainer, every rank): resolve the plan's data and split it into
   size-balanced buckets, one file each;
2. ``preload_fn`` (trainer before a forked writer, or the persistent worker): stage every
   tensor to host memory, a real snapshot (see :mod:`megatron_async.staging.buckets`);
3. ``save_fn`` (background writer): write the staged buckets with threads or processes
   and report the results through a :class:`~megatron_async.writer.results.ResultFile`;
   the ``write_preloaded_data*`` static methods are the reference API's names for these
   write paths and delegate to :mod:`megatron_async.writer.write_paths`;
4. ``retrieve_write_results`` and ``finish`` (trainer, in the request's finalization):
   collect the results, and on the coordinator write ``.metadata`` atomically.

The files are PyTorch DCP's ``torch_save`` layout, so stock ``FileSystemReader``\\ s and
megatron-core's loader read them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import threading
import traceback
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

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
    WorkerDiedError,
)
from megatron_async.format import DCP_METADATA_FILE
from megatron_async.staging.buckets import StagingBufferCache, stage_buckets
from megatron_async.storage.client import MSC_EXTRA_HINT, import_msc
from megatron_async.storage.backend import normalize_checkpoint_path, storage_for
from megatron_async.storage.locations import DEFAULT_PART_BYTES, MIN_PART_BYTES
from megatron_async.writer import write_paths
from megatron_async.writer.buckets import BucketLayout, WriteBucket, assign_buckets, materialize_buckets
from megatron_async.writer.commit import commit_checkpoint
from megatron_async.writer.results import ResultFile
from megatron_async.writer.write_paths import SpecBucketWriter

__all__ = [
    "FileSystemWriterAsync",
    "ConsistentDataIdentifier",
    "get_write_results_queue",
    "DEFAULT_WRITE_TIMEOUT_S",
    "METADATA_FILE_NAME",
]

logger = logging.getLogger(__name__)

DEFAULT_WRITE_TIMEOUT_S = 3600.0
"""How long the background writer waits for one save's bucket threads or processes."""

METADATA_FILE_NAME = DCP_METADATA_FILE
"""DCP's global metadata file (kept under this name for older imports)."""


WrappedException = Tuple[BaseException, traceback.StackSummary]
"""PyTorch DCP's form of a failure that is returned rather than raised."""


@dataclasses.dataclass(frozen=True)
class ConsistentDataIdentifier:
    """Names the reusable staging buffers of one bucket layout (trainer side).

    Travels in ``resolved_plan_data`` instead of the buffers themselves; the buffers stay
    in the stager's :class:`~megatron_async.staging.buckets.StagingBufferCache`.

    Attributes:
        key: a digest of everything that decides the buffers' shapes.
    """

    key: str


ResolvedPlanData = Tuple[str, Tuple[Optional[ConsistentDataIdentifier], List[WriteBucket]]]
"""``(checkpoint_dir, (identifier, write_buckets))``: what ``preload_tensors`` stages."""


_results_queues: Dict[str, Any] = {}
_results_queues_lock = threading.Lock()


def get_write_results_queue(mp_mode: str = "spawn") -> Any:
    """Return this process's queue for write results, created on first use (trainer side).

    A multiprocessing manager's queue of the given start method (``"spawn"``, ``"fork"``
    or ``"forkserver"``): its handle pickles, so background processes of any kind can
    ``put`` into it. Our writers report through a results file instead (see
    :mod:`megatron_async.writer.results`); this queue is for code written against the
    reference API that passes its own ``global_results_queue`` to the write paths or sets
    a writer's ``results_queue``: ``retrieve_write_results`` reads either.

    Raises:
        CheckpointValidationError: an unknown start method.
    """
    if mp_mode not in mp.get_all_start_methods():
        raise CheckpointValidationError(
            f"mp_mode must be one of {mp.get_all_start_methods()}, got {mp_mode!r}"
        )
    with _results_queues_lock:
        if mp_mode not in _results_queues:
            _results_queues[mp_mode] = mp.get_context(mp_mode).Manager().Queue()
        return _results_queues[mp_mode]


_RESULTS_QUEUE_WAIT_S = 5.0
"""How long ``retrieve_write_results`` waits on a results queue for an outcome that the
finished background part must already have put (a manager queue delivers with a delay)."""


def _take_payload(channel: Any) -> Tuple[Any, Optional[BaseException]]:
    """Read a save's outcome from its channel (trainer side): ``(payload, None)`` or
    ``(None, why nothing could be read)``."""
    try:
        if isinstance(channel, ResultFile):
            return channel.take(), None
        return channel.get(timeout=_RESULTS_QUEUE_WAIT_S), None
    except (OSError, EOFError, pickle.UnpicklingError, queue.Empty) as exc:
        if isinstance(channel, ResultFile):
            channel.discard()
        return None, exc


def _wrap(exc: BaseException) -> WrappedException:
    """DCP's wrapped form of ``exc``, with the traceback where it was first raised."""
    failure = getattr(exc, "failure", None)
    stack = getattr(failure, "stack", None) or traceback.extract_tb(exc.__traceback__)
    return exc, stack


def _bind_supported(fn: Callable[..., Any], args: tuple, **options: Any) -> "partial[Any]":
    """``partial(fn, *args, **options)`` without the options ``fn`` does not take.

    A subclass may override a write path with the reference API's signature only; it
    then runs without our extra options (checksums, bounded waits) instead of failing.
    """
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        options = {k: v for k, v in options.items() if k in params}
    return partial(fn, *args, **options)


def _unpack_resolved_plan_data(
    resolved_plan_data: Any,
) -> Tuple[Optional[ConsistentDataIdentifier], Sequence[WriteBucket]]:
    try:
        _, (identifier, write_buckets) = resolved_plan_data
    except (TypeError, ValueError):
        identifier, write_buckets = None, None
    if (identifier is not None and not isinstance(identifier, ConsistentDataIdentifier)) or not (
        isinstance(write_buckets, (list, tuple))
        and all(isinstance(b, WriteBucket) for b in write_buckets)
    ):
        raise CheckpointValidationError(
            "preload_tensors expects (checkpoint_dir, (ConsistentDataIdentifier or None, "
            "write_buckets)), the writer's resolved_plan_data after prepare_write_data; got "
            f"{type(resolved_plan_data).__name__}"
        )
    return identifier, write_buckets


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
        direct_io: write local files with ``O_DIRECT`` (through an aligned bounce
            buffer), bypassing the page cache, where the file system accepts it; False
            writes buffered (see :mod:`megatron_async.writer.direct_io`).
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
        direct_io: bool = True,
        **kwargs: Any,
    ):
        if use_msc:
            import_msc()  # a clear error naming the extra before anything else
        elif storage_for(path).needs_msc:
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
        self.direct_io = bool(direct_io)
        self.can_run_decentralized_global_plan = True

        self.write_buckets: Optional[List[WriteBucket]] = None
        self.resolved_plan_data: Optional[ResolvedPlanData] = None
        self.results_queue: Any = None
        """Where the background writer reports (a :class:`ResultFile` per save; anything
        with ``put`` and ``get``, such as :func:`get_write_results_queue`, also works)."""
        self.write_elapsed_s: Optional[float] = None
        """How long the background write took, once ``retrieve_write_results`` succeeded."""
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
        identifier = (
            ConsistentDataIdentifier(self._staging_key) if self.use_cached_data_structure else None
        )
        self.resolved_plan_data = (self.checkpoint_dir, (identifier, self.write_buckets))
        self.results_queue = (
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
    ) -> Tuple[Optional[Callable[..., None]], Optional[Callable[[], Any]], Optional[List[Any]]]:
        """Return ``(save_fn, preload_fn, args)``, or ``(None, None, None)`` with nothing to write.

        Runs in the trainer. ``save_fn`` is ``write_preloaded_data_multithread`` (or
        ``_multiproc``) with ``(transform_list, use_msc, open_file)`` bound, ``preload_fn``
        is ``preload_tensors`` with ``(resolved_plan_data, non_blocking)`` bound; both are
        ``functools.partial`` objects of static methods, so they pickle to the persistent
        worker, and a subclass's overrides are the ones used. ``args`` is
        ``[rank, None, results_queue]``: the caller replaces ``args[1]`` by the result of
        ``preload_fn`` (the staged buckets) before calling ``save_fn(*args)``.
        """
        if not self.write_buckets:
            return None, None, None
        write_fn = (
            self.write_preloaded_data_multiproc
            if self.is_multiproc_io
            else self.write_preloaded_data_multithread
        )
        save_fn = _bind_supported(
            write_fn,
            (self.transforms, self.use_msc, self._open_file()),
            use_fsync=self.sync_files,
            write_timeout_s=self.write_timeout_s,
            bucket_writer=type(self).write_preloaded_data,
            compute_checksums=self.checksums,
            direct_io=self.direct_io,
        )
        if self.overlap_staging:
            return self._overlapped_functions(save_fn)
        preload_fn = _bind_supported(
            self.preload_tensors, (self.resolved_plan_data, True), staging_cache=self.staging_cache
        )
        return save_fn, preload_fn, [coordination.get_rank(), None, self.results_queue]

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
        identifier, write_buckets = _unpack_resolved_plan_data(self.resolved_plan_data)
        preload_fn = partial(
            stage_buckets_overlapped, gate, rank, write_buckets, True,
            identifier.key if identifier is not None else None, self.staging_cache,
        )
        save_fn = partial(write_after_staging, gate, DEFAULT_STAGING_WAIT_S, save_fn)
        return save_fn, preload_fn, [rank, None, self.results_queue]

    def _open_file(self) -> Callable[..., Any]:
        """The ``open_file`` the write paths get: ``open``, or the object store's opener."""
        if not self.use_msc:
            return open
        from megatron_async.storage.stream import ObjectStoreFileOpener

        return ObjectStoreFileOpener(self.object_part_bytes)

    @staticmethod
    def preload_tensors(
        resolved_plan_data: ResolvedPlanData,
        non_blocking: bool = True,
        *,
        staging_cache: Optional[StagingBufferCache] = None,
    ) -> List[WriteBucket]:
        """Stage the prepared buckets' tensors to host memory: a snapshot (trainer, every rank).

        CUDA tensors go to pinned buffers (non-blocking copies, one synchronize); CPU
        tensors are copied as well, so later in-place updates never reach the file.

        Args:
            resolved_plan_data: ``(checkpoint_dir, (identifier, write_buckets))`` as
                ``prepare_write_data`` left it in :attr:`resolved_plan_data`. With a
                :class:`ConsistentDataIdentifier`, the buffers staged under that key by an
                earlier save are reused (``use_cached_data_structure``); None stages into
                fresh buffers.
            non_blocking: pinned buffers and asynchronous copies for CUDA tensors.
            staging_cache: where the reusable buffers live (the trainer's);
                :func:`~megatron_async.staging.buckets.default_staging_cache` when None.

        Returns:
            The staged buckets (a :class:`~megatron_async.staging.buckets.StagedBuckets`).
        """
        identifier, write_buckets = _unpack_resolved_plan_data(resolved_plan_data)
        key = identifier.key if identifier is not None else None
        return stage_buckets(write_buckets, non_blocking, key, staging_cache)

    # The reference API's single-bucket write paths (background writer), as static
    # methods so that subclasses override them and the save function still pickles.
    write_preloaded_data = staticmethod(write_paths.write_preloaded_data)
    write_preloaded_data_proc = staticmethod(write_paths.write_preloaded_data_proc)

    @staticmethod
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
    ) -> None:
        """Write the staged buckets, one thread each, and report the outcome (background).

        The last bucket is written by the calling thread. A failed bucket is recorded in
        the outcome, not raised: the trainer's finalization turns it into an error on
        every rank. What goes to ``global_results_queue`` (the writer's results file, or
        any object with ``put``, e.g. :func:`get_write_results_queue`) is a dict bucket
        index -> write results, or the :class:`~megatron_async.errors.StorageWriteError` that says what failed.

        Args:
            transform_list, use_msc, open_file: see :meth:`write_preloaded_data`.
            rank: the training rank (for messages).
            write_buckets: the staged buckets (``preload_fn``'s result).
            global_results_queue: where the outcome goes.
            use_fsync: make every file durable.
            write_timeout_s: bound on the wait for the writer threads.
            bucket_writer: writes one bucket; ``write_preloaded_data`` when None.
            compute_checksums: hash every item while writing it.
            direct_io: write local files with ``O_DIRECT`` where accepted.
        """
        write_paths.write_staged_buckets(
            rank, write_buckets, global_results_queue, use_processes=False,
            transform_list=transform_list, use_msc=use_msc, open_file=open_file,
            use_fsync=use_fsync, write_timeout_s=write_timeout_s, bucket_writer=bucket_writer,
            compute_checksums=compute_checksums, direct_io=direct_io,
        )

    @staticmethod
    def write_preloaded_data_multiproc(
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
    ) -> None:
        """Write the staged buckets, one forked process each, and report the outcome.

        Runs in the background writer, which must be allowed to have children (ours
        always are). Forked children share the staged buffers; each reports through its
        own result file, so a child that dies is detected (no result) instead of awaited.
        Arguments as for :meth:`write_preloaded_data_multithread`.
        """
        write_paths.write_staged_buckets(
            rank, write_buckets, global_results_queue, use_processes=True,
            transform_list=transform_list, use_msc=use_msc, open_file=open_file,
            use_fsync=use_fsync, write_timeout_s=write_timeout_s, bucket_writer=bucket_writer,
            compute_checksums=compute_checksums, direct_io=direct_io,
        )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[WriteResult]]":
        """Write the plan synchronously (lets ``torch.distributed.checkpoint.save`` use this writer).

        A failed write is the future's result as DCP's wrapped exception, which DCP's
        ``save`` turns into a ``CheckpointException`` on every rank.
        """
        self.prepare_write_data(plan, planner)
        save_fn, preload_fn, args = self.get_save_function_and_args()
        if save_fn is not None:
            staged = preload_fn()
            try:
                save_fn(args[0], staged, args[2])
            finally:
                release = getattr(staged, "release", None)
                if release is not None:
                    release()
        future: Future = Future()
        future.set_result(self.retrieve_write_results())
        return future

    def retrieve_write_results(self) -> Union[List[WriteResult], WrappedException]:
        """Collect what the background writer reported (trainer, in finalization).

        Returns:
            The write results of every item of this rank (empty with nothing to write),
            or, when the background write failed, DCP's wrapped exception
            ``(exception, traceback.StackSummary)`` as the reference API specifies:

            * :class:`~megatron_async.errors.StorageWriteError`: a bucket failed; its ``failure`` holds the
              original exception and traceback;
            * :class:`WorkerDiedError`: the writer reported nothing (killed or crashed);
            * :class:`CheckpointIntegrityError`: a bucket reported too few results.

            Their messages keep megatron-core's wording ("Worker failure: ...", "... This
            probably indicates a worker failure."), which log alerts and Megatron-LM's
            tests search for.

        Raises:
            CheckpointIntegrityError: no write was prepared (a programming error).
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
        payload, error = _take_payload(self.results_queue)
        if error is not None:
            return _wrap(
                WorkerDiedError(
                    f"Worker failure on rank {rank}: the background writer of "
                    f"{self.checkpoint_dir} reported no result ({error}); it was probably "
                    "killed (out of memory, signal) before finishing. The checkpoint is "
                    "incomplete: save again."
                )
            )
        if isinstance(payload, BaseException):
            return _wrap(payload)
        for idx, bucket in enumerate(self.write_buckets):
            expected = len(bucket.data[0]) + len(bucket.data[1])
            got = len(payload.get(idx, ()))
            if got != expected:
                return _wrap(
                    CheckpointIntegrityError(
                        f"rank {rank}: {bucket.file_name} in {self.checkpoint_dir} reported {got} "
                        f"of {expected} written items; its writer stopped early. This probably "
                        "indicates a worker failure. Save again."
                    )
                )
        self.write_elapsed_s = getattr(payload, "elapsed_s", None)
        self._write_results = list(
            itertools.chain.from_iterable(payload[i] for i in sorted(payload))
        )
        return self._write_results

    @property
    def bytes_written(self) -> Optional[int]:
        """Bytes this rank's background write stored, once ``retrieve_write_results`` succeeded."""
        if self._write_results is None:
            return None
        return sum(result.size_in_bytes for result in self._write_results)

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
