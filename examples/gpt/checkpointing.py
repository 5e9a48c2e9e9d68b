"""Save and resume the whole training state with megatron-core's dist_checkpointing.

A checkpoint holds the training state of ``training_state.py`` (model, optimizer, RNG
states, data position and the parallel layout that saved it) and its content metadata
(the format of the optimizer state, see ``resharding.py``). :class:`Checkpointer` schedules
saves and finalizes them, records what each cost, applies the save-failure policy, and on
resume picks the newer of the two tiers. Persistent saves go through the strategy and the
queue of ``save_strategy.py``; with ``--async-save`` the write runs in the background and
:class:`~megatron_async.manager.CheckpointManager` moves the tracker only once every
rank's data is durable. Local checkpoints (``--non-persistent-ckpt-type local``,
``local_checkpoints.py``) go through the same queue. A persistent resume is checked and
loaded by ``persistent_load.py``: a run may resume with another parallel layout wherever
megatron-core can reshard the checkpoint; where it cannot, the load stops before reading
any shard and names the flag to use.

Every method of :class:`Checkpointer` runs on every rank, in the training thread.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import List, Optional

import torch
from megatron.core import dist_checkpointing

from gpt.debug_hooks import DEBUG_SAVE_DELAY_ENV, DEBUG_SAVE_FAULT_ENV, DebugSaveHooks
from gpt.local_checkpoints import LocalCheckpointer
from gpt.persistent_load import load_persistent_checkpoint
from gpt.resharding import build_content_metadata
from gpt.save_strategy import build_save_strategy, create_checkpoint_queue
from gpt.training_state import TrainingState
from megatron_async.core import AsyncCallsQueue
from megatron_async.errors import AsyncSaveFailedError
from megatron_async.manager import (
    CheckpointManager,
    CheckpointManagerConfig,
    ResumePoint,
    SaveFailurePolicy,
)
from megatron_async.storage import storage_for

__all__ = ["Checkpointer", "Resumed", "SaveRecord", "DEBUG_SAVE_DELAY_ENV", "DEBUG_SAVE_FAULT_ENV", "enable_object_storage"]

logger = logging.getLogger(__name__)

@dataclasses.dataclass(eq=False)  # one record per save: compared by identity
class SaveRecord:
    """What one save cost.

    Attributes:
        iteration: the saved iteration.
        path: the checkpoint directory (local tier: rank 0's holder directory).
        is_async: whether the write ran in the background.
        local: a local checkpoint (``--non-persistent-save-interval``), not a persistent one.
        stall_s: seconds the training loop was blocked by the save.
        background_s: seconds from scheduling to the finalize that saw the write done
            everywhere (0 for a synchronous save); it includes up to one iteration of
            waiting for that finalize.
        num_bytes: bytes in the checkpoint directory (all ranks' files; local tier: the
            parts rank 0 holds); rank 0 only.
        scheduled_at: ``time.perf_counter()`` when an async save was scheduled.
    """

    iteration: int
    path: str
    is_async: bool
    local: bool = False
    stall_s: float = 0.0
    background_s: float = 0.0
    num_bytes: int = 0
    scheduled_at: float = 0.0

    @property
    def throughput_bytes_per_s(self) -> float:
        """Bytes per second of the part that wrote: the background for async, the stall for sync."""
        seconds = self.background_s if self.is_async else self.stall_s
        return self.num_bytes / seconds if seconds > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What :meth:`Checkpointer.load` restored.

    Attributes:
        iteration: the iteration resumed from.
        consumed_samples: the data position.
        point: the persistent checkpoint loaded; None when it was the local one.
        persistent_iteration: the newest persistent checkpoint's iteration (-1: none).
    """

    iteration: int
    consumed_samples: int
    point: Optional[ResumePoint]
    persistent_iteration: int

    def describe(self) -> str:
        """One line naming the tier and the iteration."""
        if self.point is not None:
            return (f"[ckpt] resumed from the persistent checkpoint of iteration {self.iteration}: "
                    f"{self.point.path} ({self.point.reason})")
        persistent = (f"iteration {self.persistent_iteration}" if self.persistent_iteration >= 0
                      else "none")
        return (f"[ckpt] resumed from the local checkpoint of iteration {self.iteration} "
                f"(every part verified against its digest; persistent checkpoint: {persistent})")


def enable_object_storage(msc_config: Optional[str]) -> None:
    """Let ``msc://`` ``--save``/``--load`` URLs through (every rank, before any save or load).

    ``msc_config`` (``--msc-config``) becomes ``MSC_CONFIG``, multi-storage-client's
    configuration, inherited by background writers; without it MSC looks up
    ``MSC_CONFIG`` or ``~/.msc_config.yaml`` itself. megatron-core reads ``common.pt``
    and ``metadata.json`` through MSC only while its ``MultiStorageClientFeature`` is on:
    the default on 0.16.x once the package is installed, off on 0.17+ until enabled
    (Megatron-LM's ``--enable-msc``).
    """
    if msc_config is not None:
        os.environ["MSC_CONFIG"] = os.path.abspath(msc_config)
    from megatron.core.msc_utils import MultiStorageClientFeature

    MultiStorageClientFeature.enable()


class Checkpointer:
    """Saves (sync or async) and loads model, optimizer, RNG and data position.

    Args:
        args: the parsed flags (``--save``, ``--load``, ``--async-save`` ...).
        model: the megatron-core DDP-wrapped model.
        optimizer: the megatron-core optimizer of ``model``.
        queue: the queue of background saves, from
            :func:`gpt.save_strategy.create_checkpoint_queue` (created early); with
            ``--async-save`` and None, one is created here. :meth:`close` closes it.
            Local saves go through it too.
    """

    def __init__(self, args, model, optimizer, queue: Optional[AsyncCallsQueue] = None):
        self.args = args
        self.model = model
        self.optimizer = optimizer
        self.state = TrainingState(model, optimizer)
        self.manager = CheckpointManager(
            CheckpointManagerConfig(
                save_dir=args.save, load_dir=args.load, keep_last_n=args.keep_last_n,
                save_failure=SaveFailurePolicy(
                    mode=args.ckpt_save_failure,
                    max_consecutive_failures=args.ckpt_max_consecutive_save_failures,
                ),
            )
        )
        self.queue = queue if queue is not None else create_checkpoint_queue(args)
        self._strategy = None
        # Megatron-LM validates the sharding (one all-gather of every rank's shards) on the
        # first save only when --ckpt-assume-constant-structure says it cannot change.
        self._sharding_validated = False
        self._finished: List[SaveRecord] = []
        # In the order scheduled, which is the order the queue finalizes them in.
        self._pending: List[SaveRecord] = []
        self._debug = DebugSaveHooks.from_environment()
        self._failed: List[int] = []
        # What every save records as its format (Megatron-LM's sharded_state_dict metadata).
        self._content_metadata = build_content_metadata(args)
        self.local: Optional[LocalCheckpointer] = None
        if args.non_persistent_ckpt_type == "local":
            self.local = LocalCheckpointer(args, self.state, self._content_metadata)

    @property
    def in_flight(self) -> List[int]:
        """Iterations whose save was scheduled and is not finalized yet."""
        return sorted(r.iteration for r in self._pending)

    def save(self, iteration: int, consumed_samples: int, *, local: bool = False) -> Optional[SaveRecord]:
        """Save the training state of ``iteration``; with ``--async-save``, in the background.

        Returns once the state is staged (async) or written and committed (sync). The
        record of an async save is completed by the finalize that sees it durable. A
        save that fails here returns None under ``--ckpt-save-failure continue``.

        Args:
            local: save to the local tier (``--non-persistent-ckpt-type local``) instead.
        """
        start = time.perf_counter()
        record = None
        try:
            if local:
                record = SaveRecord(iteration, "", self.args.async_save, local=True)
                request = self._debug.wrap(self.local.save(iteration, consumed_samples), iteration)
            else:
                record, request = self._save(iteration, consumed_samples)
            return self._schedule(record, request, start)
        except Exception as exc:  # the failure policy decides: go on, or raise
            if record is not None and record in self._pending:
                self._pending.remove(record)
            self._save_failed(record or SaveRecord(iteration, "", False, local=local), exc)
            return None

    def _save(self, iteration: int, consumed_samples: int):
        """Start the persistent save; return its record and its request (None: done)."""
        args = self.args
        path = self.manager.prepare_save(iteration)
        record = SaveRecord(iteration, path, args.async_save)
        state_dict = self.state.sharded_state_dict(
            iteration,
            consumed_samples,
            self._content_metadata,
            is_loading=False,
            with_optimizer=not args.no_save_optim,
            with_rng=not args.no_save_rng,
        )
        request = dist_checkpointing.save(
            state_dict,
            path,
            sharded_strategy=self._save_strategy(),
            async_sharded_save=args.async_save,
            validate_access_integrity=not self._sharding_validated,
            content_metadata=self._content_metadata,
        )
        # A structure that changes anyway is still caught: every rank then plans afresh,
        # and the global plan refuses overlapping or missing shards.
        self._sharding_validated = bool(args.ckpt_assume_constant_structure)
        if request is None:
            self.manager.commit(iteration)
            return record, None
        request = self._debug.wrap(request, iteration)
        self.manager.attach_commit(request, iteration)
        return record, request

    def _schedule(self, record: SaveRecord, request, start: float) -> SaveRecord:
        """Schedule a save's request on the queue, or record a save that is done."""
        if request is None:
            record.stall_s = time.perf_counter() - start
            self._on_durable(record)
            return record
        request.add_finalize_fn(functools.partial(self._on_durable, record))
        self.queue.schedule_async_request(request)
        record.scheduled_at = time.perf_counter()
        record.stall_s = record.scheduled_at - start
        self._pending.append(record)
        return record

    def maybe_finalize(self, blocking: bool = False) -> List[SaveRecord]:
        """Finalize saves that are done on every rank; return the records finished since
        the last call (sync saves included)."""
        while self.queue is not None:
            try:
                self.queue.maybe_finalize_async_calls(blocking=blocking)
                break
            except AsyncSaveFailedError as exc:
                # Calls finalize in the order they were scheduled: the failed one is the
                # oldest save still pending. Later saves are finalized by the next round.
                self._save_failed(self._pending.pop(0), exc)
                if not blocking:
                    # One failure per poll: the caller reports it before the next poll
                    # finds another, which may be the one past the failure limit.
                    break
        finished, self._finished = self._finished, []
        return finished

    def _save_failed(self, record: SaveRecord, error: BaseException) -> None:
        """Every rank: the save of ``record`` failed; the failure policy raises or goes on."""
        if record.local:
            self.local.save_failed(record.iteration, error)
        else:
            self.manager.save_failed(record.iteration, error)
        self._failed.append(record.iteration)

    def take_failed_iterations(self) -> List[int]:
        """Iterations whose save failed (and training went on) since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def close(self) -> List[SaveRecord]:
        """Wait for every save, stop the background worker; return the last records."""
        finished = self.maybe_finalize(blocking=True)
        if self.queue is not None:
            self.queue.close()
        return finished

    def load(self) -> Optional[Resumed]:
        """Restore the newest state of the two tiers: the local checkpoint that
        ``find_latest`` agrees on, if it is at least as new as the persistent checkpoint
        that ``--load`` (and ``--ckpt-step``) select, else that one (Megatron-LM's rule).

        A persistent checkpoint is checked before anything is read, then loaded, by
        :func:`gpt.persistent_load.load_persistent_checkpoint` (integrity with
        ``--ckpt-verify-on-load``, the load flags, the parallel layout).

        Returns:
            What was resumed, or None for a fresh start.
        """
        args = self.args
        point = self.manager.find_resume_point(args.ckpt_step)
        persistent = point.iteration if point is not None else -1
        if self.local is not None:
            local = self.local.find_latest()
            if local != -1 and local >= persistent:
                state_dict = self.local.load()
                return Resumed(state_dict["iteration"], state_dict["consumed_samples"],
                               None, persistent)
            if local != -1:
                logger.warning("the local checkpoint of iteration %d is older than the "
                               "persistent one of iteration %d: resuming from the persistent",
                               local, persistent)
        if point is None:
            return None
        common = load_persistent_checkpoint(args, self.state, point.path)
        return Resumed(common["iteration"], common["consumed_samples"], point, persistent)

    def _save_strategy(self):
        """The save strategy, built once so that cached plans carry over between saves."""
        if self._strategy is None:
            self._strategy = build_save_strategy(self.args, self.model, self.optimizer)
        return self._strategy

    def _on_durable(self, record: SaveRecord) -> None:
        """Finalize side (every rank): the checkpoint is complete (persistent: and the
        tracker moved; local: every part and replica is durable on its holder)."""
        if record.is_async:
            record.background_s = time.perf_counter() - record.scheduled_at
        is_rank0 = torch.distributed.get_rank() == 0
        if record.local:
            self.local.saved()
            record.path = str(self.local.manager.local_ckpt_dir)
            if is_rank0:
                record.num_bytes = self.local.holder_bytes() or 0
        elif is_rank0:
            listing = storage_for(record.path).list_dir(record.path)  # a torch_dist checkpoint is flat
            record.num_bytes = sum(num_bytes or 0 for _, num_bytes in listing)
        if record in self._pending:
            self._pending.remove(record)
        self._finished.append(record)
