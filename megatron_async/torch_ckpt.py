"""``torch.save`` in the background: :class:`TorchAsyncCheckpoint`."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from megatron_async.storage.local import atomic_output
from megatron_async.core import coordination
from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.queue import AsyncCallsQueue
from megatron_async.core.request import AsyncRequest
from megatron_async.errors import CheckpointInProgressError, CheckpointValidationError
from megatron_async.staging import snapshot_to_host

__all__ = ["TorchAsyncCheckpoint", "save_file_atomically"]

logger = logging.getLogger(__name__)


def save_file_atomically(path: Union[str, os.PathLike], state_dict: Any, save_kwargs: Dict[str, Any]) -> None:
    """``torch.save`` to a temporary name, fsync, then rename over ``path`` (background side).

    A reader sees either the previous file or the complete new one, never a partial
    file; if anything fails, the temporary file is removed and ``path`` is untouched.
    """
    with atomic_output(path) as stream:
        torch.save(state_dict, stream, **save_kwargs)


class TorchAsyncCheckpoint:
    """Save state dicts with ``torch.save`` in the background, one file per call.

    Every rank that uses it owns one instance. ``async_save`` takes a snapshot of the
    tensors on host memory (so the caller may modify them as soon as it returns) and
    writes the file in a background process; ``finalize_async_save`` reaps finished
    saves (and raises a failed one).

    Args:
        persistent_queue: use one long-lived worker instead of a forked process per save.
        config: timeouts of the background work.

    In a distributed job, construct it on every rank (each rank's saves take part in
    the same coordination collectives).
    """

    def __init__(self, persistent_queue: bool = False, *, config: Optional[AsyncCallerConfig] = None):
        self._queue = AsyncCallsQueue(persistent=persistent_queue, config=config)
        self._paths_in_flight: Dict[int, Path] = {}

    def async_save(self, state_dict: Any, *args: Any, **kwargs: Any) -> int:
        """Start saving ``state_dict`` like ``torch.save(state_dict, f, **kwargs)``.

        Args:
            state_dict: any object ``torch.save`` accepts; its tensors are snapshotted.
            f: (first positional argument or ``f=``) the destination path.
            **kwargs: forwarded to ``torch.save`` (for example ``pickle_protocol``).

        Returns:
            The call index of the save.

        Raises:
            CheckpointValidationError: ``f`` is not a path or its directory is missing.
            CheckpointInProgressError: a save to the same path is still in flight.
        """
        save_kwargs = dict(kwargs)
        if args:
            path, extra = args[0], args[1:]
            if extra:
                raise CheckpointValidationError(
                    "TorchAsyncCheckpoint.async_save(state_dict, f, **kwargs): pass torch.save "
                    "options by keyword"
                )
        elif "f" in save_kwargs:
            path = save_kwargs.pop("f")
        else:
            raise CheckpointValidationError("TorchAsyncCheckpoint.async_save needs a destination path f")
        if not isinstance(path, (str, os.PathLike)):
            raise CheckpointValidationError(
                f"TorchAsyncCheckpoint saves to a path, got {type(path).__name__}; file objects "
                "cannot be written from a background process"
            )
        target = Path(path).absolute()
        if not target.parent.is_dir():
            raise CheckpointValidationError(
                f"cannot save to {target}: directory {target.parent} does not exist; create it first"
            )
        self._forget_settled_saves()
        if target in self._paths_in_flight.values():
            raise CheckpointInProgressError(
                f"a save to {target} is still in flight; call finalize_async_save(blocking=True) "
                "before saving to the same path again, or save to another path"
            )
        request = AsyncRequest(
            async_fn=save_file_atomically,
            async_fn_args=(str(target), None, save_kwargs),
            finalize_fns=[],
            preload_fn=functools.partial(snapshot_to_host, state_dict),
        )
        idx = self._queue.schedule_async_request(request)
        self._paths_in_flight[idx] = target
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
        no_dist = no_dist or not coordination.is_distributed()
        try:
            finalized = self._queue.maybe_finalize_async_calls(blocking=blocking, no_dist=no_dist)
        finally:
            self._forget_settled_saves()
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
            self._paths_in_flight.clear()

    def _forget_settled_saves(self) -> None:
        pending = set(self._queue.unfinalized_call_indices())
        for idx in list(self._paths_in_flight):
            if idx not in pending:
                del self._paths_in_flight[idx]
