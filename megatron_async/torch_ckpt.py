"""``torch.save`` in the background: :class:`TorchAsyncCheckpoint`."""

from __future__ import annotations

import functools
import os
import pickle
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.queue import AsyncCallsQueue
from megatron_async.core.request import AsyncRequest, SaveDetails
from megatron_async.core.save_directories import Claim, SaveDirectories
from megatron_async.errors import CheckpointValidationError, QueueClosedError
from megatron_async.staging.budget import StagingBufferCache, validate_staging_memory_limit
from megatron_async.core.config import STAGING_WAIT_S
from megatron_async.staging.torch_save import stage_torch_save
from megatron_async.writer.torch_save_file import write_torch_save_file

__all__ = ["TorchAsyncCheckpoint"]


class _SaveReport:
    """The finalize step of one save (trainer): nothing to commit, the file is in place once
    the writer is done; it frees the file's claim when the save is over (finalized or
    abandoned) and gives the queue's INFO line the file and the staging figures."""

    def __init__(self, path: Path, claim: Claim, staging_stats: Dict[str, int]):
        self._path = path
        self._claim = claim
        self._stats = staging_stats

    def __call__(self) -> None:
        self._claim.release()

    abandon = __call__  # a failed or refused save frees the file too

    def save_details(self) -> SaveDetails:
        try:
            size = self._path.stat().st_size
        except OSError:  # a failed save is only named (the error's headline); no file then
            size = 0
        stats = self._stats
        return SaveDetails(str(self._path), size, stats.get("peak_bytes", 0), stats.get("rounds", 0))


class TorchAsyncCheckpoint:
    """Save state dicts with ``torch.save`` in the background, one file per call.

    In a distributed job every rank constructs one (its queue joins the coordination
    group). ``async_save`` snapshots the object (the caller may modify it as soon as it
    returns) and writes the file in a background process; ``finalize_async_save`` reaps
    finished saves (and raises a failed one). The file holds what ``torch.save`` writes
    for the host copy of the object (tensors load on the CPU). Staging stays within
    ``staging_memory_limit``, shared with the torch_dist saves of the same process
    (:mod:`megatron_async.staging.torch_save`).

    Args:
        persistent_queue: use one long-lived worker instead of a forked process per save.
        config: timeouts of the background work.
        staging_memory_limit: the most host memory the staged tensors of this process's
            saves may hold at once: bytes (int), a fraction in (0, 1] of the node's memory
            shared by its local ranks (float), or None for one copy of the saved tensors.
    """

    def __init__(
        self,
        persistent_queue: bool = False,
        *,
        config: Optional[AsyncCallerConfig] = None,
        staging_memory_limit: Union[int, float, None] = None,
    ):
        validate_staging_memory_limit(staging_memory_limit)
        self.staging_memory_limit = staging_memory_limit
        self.staging_stats: Dict[str, int] = {}
        """``rounds`` and ``peak_bytes`` of the latest save's staging."""
        self.staging_cache = StagingBufferCache()
        """Keeps the staging segment of a state within the budget for its next save."""
        self._queue = AsyncCallsQueue(persistent=persistent_queue, config=config)

    def async_save(
        self,
        state_dict: Any,
        f: Union[str, os.PathLike],
        pickle_module: Any = pickle,
        pickle_protocol: int = torch.serialization.DEFAULT_PROTOCOL,
        _use_new_zipfile_serialization: bool = True,
        _disable_byteorder_record: bool = False,
    ) -> int:
        """Start saving ``state_dict`` like ``torch.save`` with the same arguments.

        Args:
            state_dict: any object ``torch.save`` accepts; its tensors are snapshotted.
            f: the destination path.

        Returns:
            The call index of the save.

        Raises:
            CheckpointValidationError: ``f`` is not a path, is a directory, or its
                directory is missing, or the legacy format is asked for.
            CheckpointInProgressError: a save of this process to the same path is not
                finalized yet, or a file-system step was left behind (restart the job).

        A save that cannot stage within ``staging_memory_limit`` fails without touching
        the file: ``finalize_async_save`` raises ``AsyncSaveFailedError`` whose failure is
        the :class:`~megatron_async.errors.StagingMemoryError` saying what to do.
        """
        if not isinstance(f, (str, os.PathLike)):
            raise CheckpointValidationError(
                f"TorchAsyncCheckpoint saves to a path, got {type(f).__name__}; file objects "
                "cannot be written from a background process"
            )
        target = Path(f).absolute()
        if not target.parent.is_dir():
            raise CheckpointValidationError(
                f"cannot save to {target}: directory {target.parent} does not exist; create it first"
            )
        if target.is_dir():
            raise CheckpointValidationError(
                f"cannot save to {target}: it is a directory; torch.save writes one file, so "
                f"name a file (for example {target}/model.pt)"
            )
        if not _use_new_zipfile_serialization:
            raise CheckpointValidationError(
                "TorchAsyncCheckpoint writes torch.save's zip format only; save the legacy "
                "format (_use_new_zipfile_serialization=False) with torch.save directly"
            )
        # Released by the request's finalize step, or when the queue abandons it.
        claim = SaveDirectories.of_process().claim(
            str(target), "call finalize_async_save(blocking=True) first, or save to another path"
        )
        self.staging_stats = {}
        request = AsyncRequest(
            async_fn=write_torch_save_file,
            async_fn_args=(str(target), None),
            finalize_fns=[_SaveReport(target, claim, self.staging_stats)],
            preload_fn=functools.partial(
                stage_torch_save, state_dict, pickle_module, pickle_protocol, not _disable_byteorder_record,
                self.staging_memory_limit, STAGING_WAIT_S, self.staging_stats,
                cache=self.staging_cache,
            ),
        )
        try:
            idx = self._queue.schedule_async_request(request)
        except QueueClosedError as exc:
            raise QueueClosedError(
                "this TorchAsyncCheckpoint is closed (close() or finalize_async_save("
                "terminate=True)); create a new TorchAsyncCheckpoint to save again"
            ) from exc
        return idx

    def finalize_async_save(self, blocking: bool = False, no_dist: bool = True, terminate: bool = False) -> List[int]:
        """Reap finished saves; with ``blocking`` wait for all; with ``terminate`` close.

        Args:
            blocking: wait until every save is done.
            no_dist: look at this rank's saves only (the default: each rank writes its
                own file). With False, every rank must call it and a save counts as done
                only once it is done on all ranks.
            terminate: close the queue afterwards (stops the persistent worker).

        Returns:
            Indices of the saves finalized by this call.

        Raises:
            AsyncSaveFailedError: a save failed (on any rank, when ``no_dist`` is False).
        """
        finalized = self._queue.maybe_finalize_async_calls(blocking=blocking, no_dist=no_dist)
        if terminate:
            self.close()
        return finalized

    def close(self, abort: bool = False) -> None:
        """Stop the background processes (after finishing pending saves unless ``abort``)."""
        try:
            if not abort:
                self.finalize_async_save(blocking=True)
        finally:
            self._queue.close(abort=True)
