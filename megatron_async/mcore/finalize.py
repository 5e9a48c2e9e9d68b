"""A gloo-safe replacement for megatron-core's ``metadata.json`` finalize step.

megatron-core's ``dist_checkpointing.save(..., async_sharded_save=True)`` appends a
finalize function to the returned request that writes ``metadata.json`` on rank 0 and then
waits in a barrier on the *default* process group. If rank 0 fails to write the file, it
raises alone and the other ranks sit in that barrier until the default group's timeout
(10-30 minutes), where a training collective of rank 0 may even pair with it.

Our requests therefore carry a :class:`FinalizeFnList`: when megatron-core appends that
step, the list stores an equivalent one instead, which writes ``metadata.json`` atomically
(temporary file, fsync, rename) on rank 0 and agrees on the outcome over the gloo
coordination group, so a failure raises the same error on every rank. Runs on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import os
from typing import Any, Callable, Iterable, Optional

from megatron_async.format import MEGATRON_METADATA_FILE, write_atomically
from megatron_async.core import coordination
from megatron_async.errors import RankFailure

__all__ = ["FinalizeFnList", "write_megatron_config"]

logger = logging.getLogger(__name__)

_MEGATRON_STEP = ("megatron.core.dist_checkpointing.serialization", "save.<locals>.metadata_finalize_fn")


def write_megatron_config(checkpoint_dir: str, backend: str, version: int) -> None:
    """Write megatron-core's ``metadata.json`` on rank 0; raise any failure on every rank."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig

    failure: Optional[RankFailure] = None
    if coordination.get_rank() == 0:
        final_path = os.path.join(checkpoint_dir, MEGATRON_METADATA_FILE)
        try:
            config = dataclasses.asdict(CheckpointingConfig(backend, version))
            write_atomically(final_path, json.dumps(config))
        except Exception as exc:  # raised on every rank below
            logger.error("rank 0: writing %s failed: %s", final_path, exc)
            failure = RankFailure.from_exception(0, "finalize", exc)
    coordination.raise_if_any_rank_failed(failure, checkpoint=checkpoint_dir)


def _replacement_for(fn: Callable[[], None]) -> Optional[Callable[[], None]]:
    """Our equivalent of megatron-core's ``metadata.json`` step, or None for other functions."""
    if (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) != _MEGATRON_STEP:
        return None
    try:
        captured = inspect.getclosurevars(fn).nonlocals
        strategy, checkpoint_dir = captured["sharded_strategy"], captured["checkpoint_dir"]
        return functools.partial(
            write_megatron_config, os.fspath(checkpoint_dir), strategy.backend, strategy.version
        )
    except (KeyError, AttributeError, TypeError) as exc:  # another megatron-core layout
        logger.warning("keeping megatron-core's own metadata.json step (%s)", exc)
        return None


class FinalizeFnList(list):
    """Finalize functions of a request; swaps in the gloo-safe ``metadata.json`` step."""

    def __init__(self, fns: Iterable[Callable[[], Any]] = ()):
        super().__init__()
        for fn in fns:
            self.append(fn)

    def append(self, fn: Callable[[], Any]) -> None:
        super().append(_replacement_for(fn) or fn)
