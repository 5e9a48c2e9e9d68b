"""The megatron-core save strategy: ``torch_dist`` checkpoints written in the background.

Plug it into megatron-core like its own strategy::

    strategy = TorchDistAsyncSaveStrategy(thread_count=2)
    strategy.use_cached_ckpt_structure = True    # Megatron-LM: --ckpt-assume-constant-structure
    request = dist_checkpointing.save(sharded_state_dict, ckpt_dir,
                                      sharded_strategy=strategy, async_sharded_save=True)
    queue.schedule_async_request(request)

The checkpoint is megatron-core's ``torch_dist`` format, version 1 (megatron-core writes
``metadata.json`` from the strategy's backend), so stock megatron-core and PyTorch DCP load
it without this package. ``register_strategies()`` makes the strategy megatron-core's
default for the backend name ``'megatron_async'``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from torch.distributed.checkpoint.metadata import Metadata

from megatron_async.core import coordination
from megatron_async.core.request import AsyncRequest, SaveDetails
from megatron_async.core.save_directories import Claim, SaveDirectories
from megatron_async.errors import CheckpointValidationError, FrozenRequestError
from megatron_async.integrity.staleness import ChangeReport
from megatron_async.mcore import generation
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.mcore.plan_cache import COORDINATOR_RANK, PlanCache, PreparedSave
from megatron_async.mcore.save_call import FinalizeFnList, current_save_call, guard_save_functions
from megatron_async.mcore.target import check_save_target
from megatron_async.saver.finalize import PreviousSave, save_state_dict_async_finalize
from megatron_async.staging.budget import StagingBufferCache, StagingLedger
from megatron_async.storage.backend import normalize_checkpoint_path
from megatron_async.writer.filesystem import FileSystemWriterAsync

__all__ = [
    "TorchDistSaveConfig",
    "TorchDistAsyncSaveStrategy",
    "REGISTERED_BACKEND",
    "register_strategies",
]

logger = logging.getLogger(__name__)

REGISTERED_BACKEND = "megatron_async"
"""Backend name under which :func:`register_strategies` registers the strategy."""


def _config_property(field: str) -> property:
    """A strategy attribute that reads and writes ``config.<field>``."""

    def read(self):
        return getattr(self.config, field)

    def write(self, value):
        self.config = dataclasses.replace(self.config, **{field: value})

    return property(read, write, doc=f"``config.{field}`` under megatron-core's name.")


class TorchDistAsyncSaveStrategy(generation.StrategyBase):
    """megatron-core async save strategy writing ``torch_dist`` v1 checkpoints.

    Construct it on every rank (the options must be the same everywhere). Its methods
    run on every rank; the coordinator is rank 0.

    Args:
        backend: must be ``'torch_dist'`` (megatron-core records it in ``metadata.json``
            and picks its loader from it).
        version: must be 1.
        config: the options; see :class:`TorchDistSaveConfig`.
        **options: fields of :class:`TorchDistSaveConfig`, overriding ``config``
            (megatron-core's ``keep_only_main_replica``, ``thread_count``,
            ``cached_metadata`` and ``separation_hint`` keep their meaning).

    Raises:
        CheckpointValidationError: an unknown backend or version, or a bad option.

    Attributes:
        config: the options in force.

    Copies: ``copy.copy``, ``copy.deepcopy`` and pickling give an independent strategy
    with the same options and empty caches (no cached plans or metadata, no staging
    buffers). A setter replaces the immutable ``config``, so setting an option on a copy
    (megatron-core's tests deep-copy the registered default strategy) never changes the
    original; caches are never shared, as a staging buffer may still be leased to a save
    in flight. Call :meth:`release_staging_buffers` on a strategy you stop using.
    """

    _CACHES = ("plan_cache", "staging_cache", "previous_save")

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        config: Optional[TorchDistSaveConfig] = None,
        **options: Any,
    ):
        if backend != "torch_dist" or version != 1:
            raise CheckpointValidationError(
                f"TorchDistAsyncSaveStrategy writes torch_dist version 1 checkpoints, got "
                f"backend={backend!r} version={version!r}; use ('torch_dist', 1)"
            )
        try:
            chosen = dataclasses.replace(config or TorchDistSaveConfig(), **options)
        except TypeError as exc:
            raise CheckpointValidationError(
                f"unknown TorchDistAsyncSaveStrategy option: {exc}; valid options are "
                f"{[f.name for f in dataclasses.fields(TorchDistSaveConfig)]}"
            ) from exc
        # megatron-core 0.17+'s base __init__ assigns its own defaults to the attributes
        # that are properties here (thread_count, use_cached_ckpt_structure, ...): let it
        # write into a throw-away config, then put the chosen options in force.
        self.config = TorchDistSaveConfig()
        # The process's record of directories being written, which megatron-core's
        # common.pt guard checks too; copies share it.
        self.directories = SaveDirectories.of_process()
        self._create_caches()
        generation.StrategyBase.__init__(self, backend, version)
        self.config = chosen

    def _create_caches(self) -> None:
        """Give this strategy empty caches (at construction, and in every copy)."""
        self.plan_cache = PlanCache()
        self.staging_cache = StagingBufferCache()
        self.previous_save = PreviousSave()

    def __getstate__(self) -> Dict[str, Any]:
        """Return what a copy or a pickle keeps: every attribute but the caches."""
        return {name: value for name, value in vars(self).items() if name not in self._CACHES}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Restore a copy's attributes and give it empty caches of its own."""
        self.__dict__.update(state)
        self._create_caches()

    @property
    def cached_global_metadata(self) -> Optional[Metadata]:
        """With ``cached_metadata``, the metadata the coordinator reuses while the structure
        is unchanged. Set it on every rank to a loaded checkpoint's metadata
        (``TorchDistLoadShardedStrategy.cached_global_metadata``) to let the first save of
        a resumed job skip the plan gather too: it is verified against fresh plans, never
        reused blindly."""
        return self.plan_cache.cached_global_metadata

    @cached_global_metadata.setter
    def cached_global_metadata(self, metadata: Optional[Metadata]) -> None:
        self.plan_cache.cached_global_metadata = metadata

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def release_staging_buffers(self) -> None:
        """Free the staging buffers kept for the next save (every rank, between saves).

        Buffers of a save still being written are freed when that write is over. The next
        save allocates new ones (and keeps them again, unless
        ``config.use_cached_data_structure`` is False). The pool of a save staged in
        rounds (see :mod:`megatron_async.staging.budget`) is freed the same way.
        """
        self.staging_cache.clear()
        StagingLedger.of_process().drop_pool()

    # megatron-core's attribute names for options that live in ``config`` here; its
    # fully parallel wrapper and Megatron-LM read or set them on the strategy.
    thread_count = _config_property("thread_count")
    keep_only_main_replica = _config_property("keep_only_main_replica")
    separation_hint = _config_property("separation_hint")
    # Megatron-LM's --ckpt-assume-constant-structure. megatron-core 0.19 also reuses its
    # staging buffers under it; ours are reused whatever it says (use_cached_data_structure).
    use_cached_ckpt_structure = _config_property("cached_metadata")

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        """Save synchronously through the same pipeline (every rank): plan, stage, write,
        commit, then return. megatron-core's ``save(..., async_sharded_save=False)`` calls it."""
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()

    def async_save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: Union[str, Path],
        async_strategy: Optional[str] = None,
    ) -> AsyncRequest:
        """Plan the save and return the request that writes it (every rank, synchronous).

        Nothing is written here: scheduling the returned request stages the data (a
        snapshot) and writes it in the background; its finalization writes ``.metadata``
        once every rank's data is written.

        Args:
            sharded_state_dict: megatron-core sharded state dict (ShardedTensors and
                ShardedObjects).
            checkpoint_dir: an existing directory, the same on every rank.
            async_strategy: megatron-core 0.17+ passes which async module set it would
                use (``"nvrx"`` or ``"mcore"``); accepted and ignored: this strategy
                always runs its own pipeline (staging, callers, writer, checksums).

        Returns:
            The request to schedule on an ``AsyncCallsQueue`` (or run with
            ``execute_sync``).

        Raises:
            CheckpointValidationError: on every rank, when the target is unusable on any
                rank or the sharding is invalid (overlapping or missing shards).
            CheckpointInProgressError: on every rank, when an unfinalized save of this
                process still writes ``checkpoint_dir``.
        """
        if not isinstance(checkpoint_dir, (str, os.PathLike)):  # the same on every rank
            raise CheckpointValidationError(
                f"checkpoint_dir must be a path (str or os.PathLike), got "
                f"{type(checkpoint_dir).__name__}; pass the checkpoint's directory"
            )
        checkpoint_dir = normalize_checkpoint_path(checkpoint_dir)
        is_coordinator = coordination.get_rank() == COORDINATOR_RANK
        claims: List[Claim] = []

        def check_target() -> bool:
            call = current_save_call()  # inside megatron-core's save()
            if call is not None:
                call.agreed = True
                if call.failure is not None:  # rank 0's common.pt step (0.16-0.18)
                    raise call.failure
            claims.append(self.directories.claim(checkpoint_dir))  # released below on failure
            # Bounded: on a hung mount even os.path.exists never returns, and this rank
            # would never reach the collective that agrees on the check.
            return self.directories.run_bounded(
                f"checking the save target {checkpoint_dir}",
                lambda: check_save_target(checkpoint_dir, self.config, is_coordinator),
            )

        start = time.monotonic()
        try:
            prepared = self.plan_cache.plan_save(
                sharded_state_dict,
                checkpoint_dir,
                self.config,
                lambda: self._create_writer(checkpoint_dir),
                check_target,
            )
            plan_s = time.monotonic() - start
            logger.debug(
                "rank %d: planned the save of %s in %.3fs (cached plans: %s)",
                coordination.get_rank(), checkpoint_dir, plan_s, self.plan_cache.last_save_reused_plans,
            )
            return self._request(prepared, claims[0], plan_s)
        except BaseException:
            for claim in claims:
                claim.release()
            raise

    def _request(self, prepared: PreparedSave, claim: Claim, plan_s: float) -> AsyncRequest:
        """Wrap a prepared save into the request that writes and then commits it."""
        save_fn, preload_fn, save_args = prepared[0].get_save_function_and_args()
        finalizer = SaveFinalizer(prepared, claim, plan_s, self.previous_save)
        claim.release_when_dropped(finalizer)  # a request dropped unfinalized frees its directory
        return AsyncRequest(
            save_fn, tuple(save_args or ()), FinalizeFnList([finalizer]), preload_fn=preload_fn
        )

    def _create_writer(self, checkpoint_dir: str) -> FileSystemWriterAsync:
        """Return the storage writer of one save (a hook for subclasses, e.g. test fakes)."""
        return FileSystemWriterAsync(
            checkpoint_dir, options=self.config.write_options, staging_cache=self.staging_cache
        )


class SaveFinalizer:
    """Commit one save of the strategy (the request's first finalize step): runs on every
    rank once its background write is done everywhere
    (:func:`~megatron_async.saver.finalize.save_state_dict_async_finalize`), and frees the
    directory for the next save whatever happens.

    Args:
        prepared: the planned save: ``(writer, metadata, dist_wrapper)``.
        claim: the save's claim on its directory, released when the save is over.
        plan_s: how long planning took.
        previous_save: the strategy's record of its previous committed save.
    """

    def __init__(
        self, prepared: PreparedSave, claim: Claim, plan_s: float, previous_save: PreviousSave
    ):
        self._prepared = prepared
        self._claim = claim
        self._plan_s = plan_s
        self._previous_save = previous_save
        self._change_report: Optional[ChangeReport] = None
        self._scheduled = False

    def __call__(self) -> None:
        try:
            self._change_report = save_state_dict_async_finalize(
                *self._prepared, previous_save=self._previous_save
            )
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
        writer, report = self._prepared[0], self._change_report
        stats = writer.staging_stats  # filled by the save's staging (empty if it failed first)
        return SaveDetails(
            self._claim.directory, writer.bytes_written or 0, stats.get("peak_bytes", 0),
            stats.get("rounds", 0), self._plan_s, writer.write_elapsed_s,
            report.summary() if report is not None else "",
        )


def register_strategies() -> None:
    """Register :class:`TorchDistAsyncSaveStrategy` with megatron-core where it has a registry.

    On megatron-core 0.16.x, ``get_default_strategy(StrategyAction.SAVE_SHARDED,
    'megatron_async', 1)`` then returns it and ``dist_checkpointing.save(...,
    sharded_strategy=('megatron_async', 1))`` uses it; the checkpoint still says
    ``torch_dist`` (the format). On every generation it wraps ``dist_checkpointing.save``
    and guards the ``common.pt`` write where megatron-core has one
    (:mod:`megatron_async.mcore.save_call`). Creating the strategy runs no collective, so
    this is safe at import time. On 0.17+ there is no registry: pass a
    :class:`TorchDistAsyncSaveStrategy` instance to ``save()``.
    """
    guard_save_functions()
    generation.register_strategies(TorchDistAsyncSaveStrategy, REGISTERED_BACKEND)
