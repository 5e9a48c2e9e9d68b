"""FileSystemWriterAsync: a PyTorch DCP file writer whose writing runs in the background.

Buckets are planned here, in the trainer on every rank;
:func:`~megatron_async.staging.stager.prepare_staged_write` puts the staging in front of
the background write (:mod:`megatron_async.writer.write_paths`), and the coordinator
commits ``.metadata`` (:mod:`megatron_async.writer.commit`). The files are PyTorch DCP's
``torch_save`` layout, so stock ``FileSystemReader``\\ s and megatron-core's loader read them.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_async.core import coordination
from megatron_async.core.request import AsyncRequest, run_staging_and_async_fn
from megatron_async.errors import CheckpointIntegrityError, CheckpointValidationError
from megatron_async.staging.budget import StagingBufferCache
from megatron_async.staging.buffers import preload_tensors
from megatron_async.staging.stager import prepare_staged_write
from megatron_async.storage.bounded_calls import BoundedFileSystem
from megatron_async.storage.client import MSC_EXTRA_HINT, msc_filesystem
from megatron_async.storage.backend import normalize_checkpoint_path, storage_for
from megatron_async.writer import write_paths
from megatron_async.buckets.layout import (
    BucketLayout,
    ConsistentDataIdentifier,
    PreparedWrite,
    ResolvedPlanData,
    WriteBucket,
    prepare_buckets,
)
from megatron_async.writer.commit import commit_checkpoint
from megatron_async.writer.metadata_bytes import MetadataTemplate
from megatron_async.writer.options import DEFAULT_WRITE_TIMEOUT_S, WriteOptions
from megatron_async.writer.tensor_archive import cache_frames
from megatron_async.writer.results import (
    ResultFile, WrappedException, collect_write_results, get_write_results_queue,
)

__all__ = [
    "FileSystemWriterAsync",
    "ConsistentDataIdentifier",
    "WriteOptions",
    "get_write_results_queue",
    "DEFAULT_WRITE_TIMEOUT_S",
]

logger = logging.getLogger(__name__)

_PARENT_SIGNATURE = inspect.signature(FileSystemWriter.__init__)
"""What the writer's positional and extra keyword arguments are bound to."""


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
        path: the checkpoint directory, or with ``use_msc`` an ``msc://PROFILE/PREFIX``
            URL of multi-storage-client.
        *args: forwarded to ``FileSystemWriter`` (``single_file_per_rank`` must stay True).
        options: how to write (see :class:`~megatron_async.writer.options.WriteOptions`),
            built and validated by the caller, e.g. the strategy's config.
        staging_cache: where the reusable staging buffers are kept (the trainer's);
            :meth:`~megatron_async.staging.budget.StagingBufferCache.of_process`
            when None.
        separation_hint, use_msc, is_multiproc_io, use_cached_data_structure: the
            reference API's keywords for these fields of ``WriteOptions``; used only
            without ``options`` (the other fields then keep their defaults).
        **kwargs: forwarded to ``FileSystemWriter`` (``thread_count`` and ``sync_files``,
            which are fields of ``WriteOptions`` too, ...).

    Raises:
        CheckpointValidationError: an unusable option, ``options`` together with
            ``thread_count`` or ``sync_files``, or an ``msc://`` path without ``use_msc``.
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
        staging_cache: Optional[StagingBufferCache] = None,
        options: Optional[WriteOptions] = None,
        **kwargs: Any,
    ):
        if not isinstance(path, (str, os.PathLike)):
            raise CheckpointValidationError(
                f"the checkpoint directory must be a path (str or os.PathLike), got "
                f"{type(path).__name__}: pass the directory to write the checkpoint into"
            )
        parent = _PARENT_SIGNATURE.bind(self, path, *args, **kwargs)
        if options is not None and {"thread_count", "sync_files"} & parent.arguments.keys():
            raise CheckpointValidationError(
                "pass thread_count and sync_files inside options (WriteOptions), not beside it"
            )
        parent.apply_defaults()
        if options is None:
            options = WriteOptions(
                thread_count=parent.arguments["thread_count"],
                sync_files=parent.arguments["sync_files"],
                separation_hint=separation_hint,
                use_msc=use_msc,
                is_multiproc_io=is_multiproc_io,
                use_cached_data_structure=use_cached_data_structure,
            )
        # DCP's FileSystemWriter keeps these two options as well: it gets their values.
        parent.arguments.update(thread_count=options.thread_count, sync_files=options.sync_files)
        use_msc = options.use_msc  # WriteOptions imported multi-storage-client for it
        if not use_msc and storage_for(path).needs_msc:
            raise CheckpointValidationError(
                f"{os.fspath(path)} is an object-storage URL; pass use_msc=True (and install "
                f"the extra: {MSC_EXTRA_HINT})"
            )
        super().__init__(*parent.args[1:], **parent.kwargs)
        if not self.single_file_per_rank:
            raise CheckpointValidationError(
                "FileSystemWriterAsync writes one file per bucket; pass single_file_per_rank=True"
            )
        self.options = options
        """The options in force (read-only: a writer serves one save)."""
        # The reference API's attribute names of four options.
        self.separation_hint = options.separation_hint
        self.use_msc = options.use_msc
        self.is_multiproc_io = options.is_multiproc_io
        self.use_cached_data_structure = options.use_cached_data_structure
        self.checkpoint_dir = normalize_checkpoint_path(path) if use_msc else str(path)
        if use_msc:  # DCP's own planning steps (mkdir, existing-checkpoint check) go through MSC
            fs, self.path = msc_filesystem(self.checkpoint_dir)
        self.fs = BoundedFileSystem(fs, options.object_request_timeout_s) if use_msc else BoundedFileSystem(self.fs)
        self.staging_cache = staging_cache
        self.can_run_decentralized_global_plan = True

        self.write_buckets: Optional[List[WriteBucket]] = None
        self.resolved_plan_data: Optional[ResolvedPlanData] = None
        self.results_queue: Any = None
        """Where the background writer reports (a :class:`ResultFile` per save; anything
        with ``put`` and ``get``, such as :func:`get_write_results_queue`, also works)."""
        self.write_elapsed_s: Optional[float] = None
        """How long the background write took, once ``retrieve_write_results`` succeeded."""
        self._write_results: Optional[List[WriteResult]] = None
        self.staging_stats: dict = {}
        """After staging: ``rounds`` and ``peak_bytes`` (staging memory) of this save."""

    def storage_meta(self):
        """DCP's storage metadata, with the ``checkpoint_id`` as a string (with ``use_msc``
        the URL, so that ``.metadata`` unpickles without multi-storage-client): the
        coordinator then reuses a save's ``.metadata`` bytes for the next save of the same
        structure (:mod:`~megatron_async.writer.metadata_bytes`)."""
        meta = super().storage_meta()
        if meta is not None:
            checkpoint_id = self.checkpoint_dir if self.use_msc else os.fspath(meta.checkpoint_id)
            meta = dataclasses.replace(meta, checkpoint_id=checkpoint_id)
        return meta

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> PreparedWrite:
        """Resolve the plan's data and split it into buckets (trainer, every rank).

        No data is copied here: staging happens in the request's ``preload_fn``.

        Args:
            plan: this rank's final plan; ``plan.storage_data`` holds the storage prefix.
            planner: the planner that resolves each write item to its data.

        Returns:
            The buckets and their layout (DCP ignores it; the saver passes it on).
        """
        resolved = [(item, planner.resolve_data(item)) for item in plan.items]
        return self.prepare_resolved_write_data(plan, resolved)

    def prepare_resolved_write_data(
        self,
        plan: SavePlan,
        resolved: Sequence[Tuple[WriteItem, Any]],
        layout: Optional[BucketLayout] = None,
        staging_key: Optional[str] = None,
    ) -> PreparedWrite:
        """Split already resolved items into buckets (trainer, every rank).

        A save whose structure did not change since the previous one resolves its items
        without a planner and passes the previous save's layout, which skips both the
        size balancing and the layout digest (its tensor frames are cached already, see
        :func:`~megatron_async.writer.tensor_archive.cache_frames`). Each argument is
        described at :func:`~megatron_async.buckets.layout.prepare_buckets`.
        """
        prepared = prepare_buckets(
            plan, resolved, self.checkpoint_dir, self.thread_count, self.separation_hint,
            self.use_cached_data_structure, layout, staging_key,
        )
        self.write_buckets = prepared.write_buckets
        if layout is None:  # a new structure: its frames, before any writer is forked
            cache_frames(data for _, data in resolved)
        identifier = (
            ConsistentDataIdentifier(prepared.staging_key) if prepared.staging_key is not None else None
        )
        self.resolved_plan_data = (self.checkpoint_dir, (identifier, self.write_buckets))
        self.results_queue = (
            ResultFile.create(f"rank{coordination.get_rank()}") if self.write_buckets else None
        )
        self._write_results = None
        logger.debug(
            "rank %d: %d items in %d buckets for %s", coordination.get_rank(), len(resolved),
            len(self.write_buckets), self.checkpoint_dir,
        )
        return prepared

    def get_save_function_and_args(
        self,
    ) -> Tuple[Optional[Callable[..., None]], Optional[Callable[[], Any]], Optional[List[Any]]]:
        """Return ``(save_fn, preload_fn, args)``, or ``(None, None, None)`` with nothing to write.

        Runs in the trainer. :func:`~megatron_async.staging.stager.prepare_staged_write`
        puts the save's staging (the memory budget, overlapped staging) in front of the
        write path; ``save_fn`` and ``preload_fn`` pickle to the persistent worker, and a
        subclass's overrides are the ones used. The caller replaces ``args[1]`` by the
        result of ``preload_fn`` (the staged buckets) before calling ``save_fn(*args)``.
        """
        if not self.write_buckets:
            return None, None, None
        write_fn = (
            self.write_preloaded_data_multiproc
            if self.is_multiproc_io
            else self.write_preloaded_data_multithread
        )
        write_options = {
            "use_fsync": self.sync_files,
            "write_timeout_s": self.options.write_timeout_s,
            "bucket_writer": type(self).write_preloaded_data,
            "compute_checksums": self.options.checksums,
            "direct_io": self.options.direct_io,
        }
        self.staging_stats = {}
        save_fn, preload_fn = prepare_staged_write(
            write_fn, (self.transforms, self.use_msc, self._open_file()), write_options,
            preload_tensors=self.preload_tensors, resolved_plan_data=self.resolved_plan_data,
            overlapped=self.options.overlap_staging, limit=self.options.staging_memory_limit,
            cache=self.staging_cache, stats=self.staging_stats,
            own_bucket_writer=type(self).write_preloaded_data is write_paths.write_preloaded_data,
        )
        return save_fn, preload_fn, [coordination.get_rank(), None, self.results_queue]

    def _open_file(self) -> Callable[..., Any]:
        """The ``open_file`` the write paths get: ``open``, or the object store's opener."""
        if not self.use_msc:
            return open
        from megatron_async.storage.stream import ObjectStoreFileOpener

        return ObjectStoreFileOpener(self.options.object_part_bytes, self.options.object_request_timeout_s)

    # The reference API's staging step (trainer) and write paths (background writer), as
    # static methods so that subclasses override them and the save function still pickles.
    preload_tensors = staticmethod(preload_tensors)
    write_preloaded_data = staticmethod(write_paths.write_preloaded_data)
    write_preloaded_data_proc = staticmethod(write_paths.write_preloaded_data_proc)
    write_preloaded_data_multithread = staticmethod(write_paths.write_preloaded_data_multithread)
    write_preloaded_data_multiproc = staticmethod(write_paths.write_preloaded_data_multiproc)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[WriteResult]]":
        """Write the plan synchronously (lets ``torch.distributed.checkpoint.save`` use this writer).

        A failed write is the future's result as DCP's wrapped exception, which DCP's
        ``save`` turns into a ``CheckpointException`` on every rank.
        """
        self.prepare_write_data(plan, planner)
        save_fn, preload_fn, args = self.get_save_function_and_args()
        if save_fn is not None:  # staged, copied beside the write when in rounds, released
            run_staging_and_async_fn(AsyncRequest(save_fn, tuple(args), [], preload_fn=preload_fn))
        future: Future = Future()
        future.set_result(self.retrieve_write_results())
        return future

    def retrieve_write_results(self) -> Union[List[WriteResult], WrappedException]:
        """Collect what the background writer reported (trainer, in finalization).

        Returns:
            The write results of every item of this rank (empty with nothing to write),
            or, when the background write failed, DCP's wrapped exception
            ``(exception, traceback.StackSummary)`` as the reference API specifies (see
            :func:`~megatron_async.writer.results.collect_write_results` for which).

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
        collected = collect_write_results(
            self.results_queue, self.write_buckets, self.checkpoint_dir, coordination.get_rank()
        )
        if len(collected) == 2 and isinstance(collected[0], BaseException):
            return collected  # DCP's wrapped exception, as the reference API specifies
        self._write_results, self.write_elapsed_s = collected
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

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> Optional[MetadataTemplate]:
        """Write ``.metadata`` atomically (coordinator only).

        Runs after every rank's data and checksum record is written; see
        :func:`megatron_async.writer.commit.commit_checkpoint`.

        Returns:
            The template of what was written, or None (DCP ignores it; the finalization
            keeps it for a warm save).
        """
        return commit_checkpoint(self.checkpoint_dir, metadata, results, self.storage_meta())
