"""The finalize steps of a strategy's request: our commit, and gloo-safe replacements for
megatron-core's steps (``metadata.json``, manifest).

:class:`SaveFinalizer` is the request's first step: the DCP commit
(:func:`~megatron_async.saver.finalize.save_state_dict_async_finalize`).

megatron-core's ``dist_checkpointing.save(..., async_sharded_save=True)`` appends a
finalize function to the returned request that writes ``metadata.json`` on rank 0 and then
waits in a barrier on the *default* process group. If rank 0 fails to write the file, it
raises alone and the other ranks sit in that barrier until the default group's timeout
(10-30 minutes), where a training collective of rank 0 may even pair with it. With
``save(..., verify_integrity=True)`` megatron-core 0.18+ appends a second such step: rank
0 writes a SHA-256 manifest of the checkpoint's files, then a default-group barrier.

Each step is replaced by one that runs rank 0's part (``metadata.json`` written
atomically, or megatron-core's own manifest writer) and agrees on the outcome over the
gloo coordination group, so a failure raises the same error on every rank. Runs on every
rank. Our requests carry a :class:`FinalizeFnList`, which swaps the step as megatron-core
appends it (so the swap holds on megatron-core's own queue too); requests that
megatron-core's stock strategy built with a plain list get the same swap when our queue
schedules them (:func:`~megatron_async.core.request.register_finalize_step_adapter`).
Both steps are recognized by where megatron-core defines them (``serialization.save``'s
local functions); this is generation glue, kept here next to :mod:`.generation`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import os
from typing import Any, Callable, Iterable, Optional

from megatron_async.core import coordination
from megatron_async.core.request import SaveDetails, register_finalize_step_adapter
from megatron_async.core.save_directories import Claim, run_coordinator_step
from megatron_async.errors import FrozenRequestError
from megatron_async.format import MEGATRON_METADATA_FILE
from megatron_async.integrity.staleness import ChangeReport
from megatron_async.saver.finalize import save_state_dict_async_finalize
from megatron_async.storage.backend import storage_for

__all__ = ["FinalizeFnList", "SaveFinalizer", "write_megatron_config", "write_integrity_manifest"]

logger = logging.getLogger(__name__)


class SaveFinalizer:
    """Commit one save of the strategy: runs on every rank once its background write is
    done everywhere, and frees the directory for the next save whatever happens.

    Args:
        writer, metadata, dist_wrapper: the planned save, for
            :func:`~megatron_async.saver.finalize.save_state_dict_async_finalize`.
        claim: the save's claim on its directory, released when the save is over.
        plan_s: how long planning took.
        records: the strategy's ``commit_cache`` and ``digest_history`` keywords of
            that finalization.
    """

    def __init__(self, writer, metadata, dist_wrapper, claim: Claim, plan_s: float, **records):
        self._args = (writer, metadata, dist_wrapper)
        self._records = records
        self._claim = claim
        self._plan_s = plan_s
        self._change_report: Optional[ChangeReport] = None
        self._scheduled = False

    def __call__(self) -> None:
        try:
            self._change_report = save_state_dict_async_finalize(*self._args, **self._records)
        finally:
            self.abandon()

    def claim_scheduling(self) -> None:
        """Called when the request is scheduled or run synchronously: a request runs once.

        Raises:
            FrozenRequestError: it was scheduled before.
        """
        if self._scheduled:
            raise FrozenRequestError(
                f"this request to save {self._claim.directory} was already scheduled or run; a "
                "request runs once: call dist_checkpointing.save again for a new one"
            )
        self._scheduled = True

    def abandon(self) -> None:
        """The save is over (finalized, failed or never scheduled): free its directory now
        (every rank)."""
        self._claim.release()

    def save_details(self) -> SaveDetails:
        """What this save cost on this rank (for the queue's INFO line)."""
        writer, report = self._args[0], self._change_report
        stats = writer.staging_stats  # filled by the save's staging
        return SaveDetails(
            self._claim.directory, self._plan_s, writer.write_elapsed_s, writer.bytes_written,
            report.summary() if report is not None else None,
            stats.get("peak_bytes"), stats.get("rounds"),
        )


_SAVE_MODULE = "megatron.core.dist_checkpointing.serialization"
_CONFIG_STEP = "save.<locals>.metadata_finalize_fn"
_MANIFEST_STEP = "save.<locals>.integrity_finalize_fn"


def write_megatron_config(checkpoint_dir: str, backend: str, version: int) -> None:
    """Write megatron-core's ``metadata.json`` on rank 0; raise any failure on every rank."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig

    final_path = os.path.join(checkpoint_dir, MEGATRON_METADATA_FILE)
    config = json.dumps(dataclasses.asdict(CheckpointingConfig(backend, version)))
    coordination.run_on_coordinator(
        "finalize",
        lambda: run_coordinator_step(
            f"writing {final_path}",
            lambda: storage_for(checkpoint_dir).write_atomically(final_path, config),
        ),
        checkpoint_dir,
    )


MANIFEST_STEP_SHARE = 0.9
"""The share of the coordination timeout that megatron-core's manifest step, which reads
and hashes every file, may take on rank 0 (never less than the other steps' half). It
keeps :data:`MANIFEST_STEP_MARGIN_S` for rank 0 to report a step that did not return
before the other ranks, waiting for it, time out themselves."""

MANIFEST_STEP_MARGIN_S = 10.0


def manifest_step_timeout_s() -> float:
    """How long megatron-core's manifest step may take on rank 0 (see :data:`MANIFEST_STEP_SHARE`)."""
    timeout_s = coordination.coordination_timeout_s()
    share_s = min(MANIFEST_STEP_SHARE * timeout_s, timeout_s - MANIFEST_STEP_MARGIN_S)
    return max(share_s, timeout_s / 2)


def write_integrity_manifest(checkpoint_dir: str, write_manifest: Callable[[str], None]) -> None:
    """Run megatron-core's manifest writer on rank 0; raise any failure on every rank."""
    coordination.run_on_coordinator(
        "finalize",
        lambda: run_coordinator_step(
            f"writing the integrity manifest of {checkpoint_dir}",
            lambda: write_manifest(checkpoint_dir),
            timeout_s=manifest_step_timeout_s(),
            hint="it reads and hashes every file of the checkpoint: if the mount is "
            "fine, the checkpoint is too large to hash in time; raise "
            "coordination_timeout_s or save without verify_integrity, then restart the job",
        ),
        checkpoint_dir,
    )


def _replacement_for(fn: Callable[[], None]) -> Optional[Callable[[], None]]:
    """Our equivalent of one of megatron-core's finalize steps, or None for other functions."""
    if getattr(fn, "__module__", None) != _SAVE_MODULE:
        return None
    step = getattr(fn, "__qualname__", None)
    if step not in (_CONFIG_STEP, _MANIFEST_STEP):
        return None
    try:
        captured = inspect.getclosurevars(fn)
        checkpoint_dir = os.fspath(captured.nonlocals["checkpoint_dir"])
        if step == _CONFIG_STEP:
            strategy = captured.nonlocals["sharded_strategy"]
            return functools.partial(
                write_megatron_config, checkpoint_dir, strategy.backend, strategy.version
            )
        write_manifest = captured.globals["save_integrity_manifest"]
        return functools.partial(write_integrity_manifest, checkpoint_dir, write_manifest)
    except (KeyError, AttributeError, TypeError) as exc:  # another megatron-core layout
        logger.warning("keeping megatron-core's own finalize step %s (%s)", step, exc)
        return None


register_finalize_step_adapter(_replacement_for)


class FinalizeFnList(list):
    """Finalize functions of a request; swaps in the gloo-safe megatron-core steps."""

    def __init__(self, fns: Iterable[Callable[[], Any]] = ()):
        super().__init__()
        for fn in fns:
            self.append(fn)

    def append(self, fn: Callable[[], Any]) -> None:
        super().append(_replacement_for(fn) or fn)
