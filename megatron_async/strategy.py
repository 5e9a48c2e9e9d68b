"""The megatron-core save strategy: ``torch_dist`` checkpoints written in the background.

Plug it into megatron-core like its own strategy::

    strategy = TorchDistAsyncSaveStrategy(thread_count=2, cached_metadata=True)
    request = dist_checkpointing.save(sharded_state_dict, ckpt_dir,
                                      sharded_strategy=strategy, async_sharded_save=True)
    queue.schedule_async_request(request)

The checkpoint is megatron-core's ``torch_dist`` format, version 1 (megatron-core writes
``metadata.json`` from the strategy's backend), so stock megatron-core and PyTorch DCP load
it without this package. ``register_strategies()`` makes the strategy megatron-core's
default for the backend name ``'megatron_async'``.

Overwriting: megatron-core's ``save()`` writes ``common.pt`` before the sharded strategy
runs, so refusing a directory that holds a complete checkpoint at that point would leave
the old checkpoint with a new ``common.pt``. By default the strategy therefore overwrites,
like megatron-core, but safely: it logs a warning and first removes the old completion
markers (``.metadata`` and ``metadata.json``), so a save that then fails leaves a
directory that every loader sees as incomplete, never a mix of old and new data.
``overwrite=False`` refuses instead (for callers that do not write ``common.pt`` first).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Dict, Optional, Union

from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from megatron_async._agreement import agree_or_raise
from megatron_async._megatron_finalize import FinalizeFnList
from megatron_async.common_guard import install_common_guard
from megatron_async.core import coordination
from megatron_async.core.request import AsyncRequest
from megatron_async.errors import CheckpointInProgressError, CheckpointValidationError
from megatron_async.filesystem_async import (
    DEFAULT_WRITE_TIMEOUT_S,
    METADATA_FILE_NAME,
    FileSystemWriterAsync,
)
from megatron_async.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)

__all__ = [
    "TorchDistSaveConfig",
    "TorchDistAsyncSaveStrategy",
    "REGISTERED_BACKEND",
    "register_strategies",
    "checkpoint_dirs_in_flight",
]

logger = logging.getLogger(__name__)

REGISTERED_BACKEND = "megatron_async"
"""Backend name under which :func:`register_strategies` registers the strategy."""

MEGATRON_METADATA_FILE_NAME = "metadata.json"
_COORDINATOR_RANK = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchDistSaveConfig:
    """Options of :class:`TorchDistAsyncSaveStrategy`."""

    thread_count: int = 2
    """Files (and writer threads or processes) per rank and save."""

    cached_metadata: bool = False
    """Reuse the previous save's plans and metadata while the checkpoint structure does not
    change (verified on every save with one small all-reduce): no plan gather then."""

    separation_hint: Optional[str] = None
    """Keys starting with this prefix are written to their own files (``{hint}__{rank}_{i}``),
    which megatron-core's ``remove_sharded_tensors`` can later drop."""

    keep_only_main_replica: bool = True
    """Save only main replicas (``replica_id`` 0). False saves every replica and lets DCP
    deduplicate, which needs central planning (one gather and one scatter per save)."""

    is_multiproc_io: bool = False
    """Write buckets with forked processes instead of threads."""

    use_cached_data_structure: bool = False
    """Keep the bucket layout and the host staging buffers from save to save (the structure
    must be constant; staging memory then stays about one checkpoint's size)."""

    overwrite: bool = True
    """A directory that holds a complete checkpoint is overwritten (its completion markers
    removed first, with a warning); False refuses it with a CheckpointValidationError."""

    sync_files: bool = True
    """fsync every file before the save counts as written."""

    checksums: bool = True
    """Hash every item while it is written (xxh3, in the background writer) and store the
    digests next to the data, for ``python -m megatron_async verify`` and
    :func:`megatron_async.integrity.verify_checkpoint_integrity`."""

    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    """Bound on the background writer's wait for its threads or processes."""

    def __post_init__(self) -> None:
        if isinstance(self.thread_count, bool) or not isinstance(self.thread_count, int):
            raise CheckpointValidationError(f"thread_count must be an int, got {self.thread_count!r}")
        if self.thread_count < 1:
            raise CheckpointValidationError(
                f"thread_count must be >= 1 (files per rank), got {self.thread_count}"
            )
        if self.separation_hint is not None and (
            not isinstance(self.separation_hint, str)
            or not self.separation_hint
            or os.sep in self.separation_hint
        ):
            raise CheckpointValidationError(
                f"separation_hint must be a non-empty key prefix without {os.sep!r} (it starts "
                f"file names), got {self.separation_hint!r}"
            )
        if not self.write_timeout_s > 0:
            raise CheckpointValidationError(
                f"write_timeout_s must be a positive number of seconds, got {self.write_timeout_s!r}"
            )


_in_flight_lock = threading.Lock()
_in_flight: Dict[str, int] = {}
_tokens = itertools.count()


def checkpoint_dirs_in_flight() -> list:
    """Directories that saves of this process are still writing or finalizing."""
    with _in_flight_lock:
        return sorted(_in_flight)


def _claim_dir(checkpoint_dir: str) -> int:
    with _in_flight_lock:
        token = next(_tokens)
        _in_flight[checkpoint_dir] = token
        return token


def _release_dir(checkpoint_dir: str, token: int) -> None:
    with _in_flight_lock:
        if _in_flight.get(checkpoint_dir) == token:
            del _in_flight[checkpoint_dir]


class _SaveFinalizer:
    """Commit one save: runs on every rank once its background write is done everywhere."""

    def __init__(self, writer, metadata, dist_wrapper, checkpoint_dir: str, token: int):
        self._args = (writer, metadata, dist_wrapper)
        self._release = (checkpoint_dir, token)

    def __call__(self) -> None:
        try:
            save_state_dict_async_finalize(*self._args)
        finally:
            _release_dir(*self._release)


class TorchDistAsyncSaveStrategy(AsyncSaveShardedStrategy):
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
        cached_global_metadata: with ``cached_metadata``, the metadata the coordinator
            reuses while the structure is unchanged. Set it on every rank to a loaded
            checkpoint's metadata (``TorchDistLoadShardedStrategy.cached_global_metadata``)
            to let the first save of a resumed job skip the plan gather too.
        last_save_reused_plans: whether the latest ``async_save`` reused cached plans.
    """

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
        super().__init__(backend, version)
        try:
            self.config = dataclasses.replace(config or TorchDistSaveConfig(), **options)
        except TypeError as exc:
            raise CheckpointValidationError(
                f"unknown TorchDistAsyncSaveStrategy option: {exc}; valid options are "
                f"{[f.name for f in dataclasses.fields(TorchDistSaveConfig)]}"
            ) from exc
        self.cached_global_metadata: Optional[Metadata] = None
        self._cached_central_plan: Optional[SavePlan] = None
        self._cached_local_plan: Optional[SavePlan] = None
        self.last_save_reused_plans = False

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    @property
    def use_cached_ckpt_structure(self) -> bool:
        """megatron-core's name for ``config.cached_metadata``.

        Megatron-LM sets it on the strategy it looked up for
        ``--ckpt-assume-constant-structure``; keeping the name makes that code path work
        with this strategy unchanged.
        """
        return self.config.cached_metadata

    @use_cached_ckpt_structure.setter
    def use_cached_ckpt_structure(self, value: bool) -> None:
        self.config = dataclasses.replace(self.config, cached_metadata=bool(value))

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]
    ) -> AsyncRequest:
        """Plan the save and return the request that writes it (every rank, synchronous).

        Nothing is written here: scheduling the returned request stages the data (a
        snapshot) and writes it in the background; its finalization writes ``.metadata``
        once every rank's data is written.

        Args:
            sharded_state_dict: megatron-core sharded state dict (ShardedTensors and
                ShardedObjects).
            checkpoint_dir: an existing directory, the same on every rank.

        Returns:
            The request to schedule on an ``AsyncCallsQueue`` (or run with
            ``execute_sync``).

        Raises:
            CheckpointValidationError: on every rank, when the target is unusable on any
                rank or the sharding is invalid (overlapping or missing shards).
            CheckpointInProgressError: on every rank, when an unfinalized save of this
                process still writes ``checkpoint_dir``.
        """
        checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
        group = coordination.get_coordination_group()
        is_coordinator = coordination.get_rank() == _COORDINATOR_RANK
        pyt_state_dict, error = None, None
        try:
            self._check_target(checkpoint_dir, is_coordinator)
            flat_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.config.keep_only_main_replica
            )
            pyt_state_dict = mcore_to_pyt_state_dict(flat_state_dict, False)
        except Exception as exc:  # agreed on below, so that no rank waits for a failed one
            error = exc
        agree_or_raise(error, f"async save to {checkpoint_dir}", (), group)

        token = _claim_dir(checkpoint_dir)
        try:
            return self._plan(pyt_state_dict, checkpoint_dir, is_coordinator, token)
        except BaseException:
            _release_dir(checkpoint_dir, token)
            raise

    def _plan(self, pyt_state_dict, checkpoint_dir: str, is_coordinator: bool, token: int):
        cfg = self.config
        use_cache = cfg.cached_metadata and self._cached_central_plan is not None
        if is_coordinator and self.cached_global_metadata is None:
            use_cache = False  # without metadata to reuse, force a fresh plan on every rank
        loaded_all_plans = (
            getattr(self.cached_global_metadata, "all_local_plans", None)
            if cfg.cached_metadata
            else None
        )
        planner = MCoreSavePlanner(
            flatten_state_dict=False,
            dedup_replicated_tensors=not cfg.keep_only_main_replica,
            can_run_decentralized_global_plan=cfg.keep_only_main_replica,
        )
        (writer, metadata, dist_wrapper), central, local, reused, reused_loaded = (
            save_state_dict_async_plan(
                pyt_state_dict,
                self._create_writer(checkpoint_dir),
                planner=planner,
                coordinator_rank=_COORDINATOR_RANK,
                cached_ckpt_structure=(
                    (self._cached_central_plan, self._cached_local_plan, True) if use_cache else None
                ),
                loaded_all_plans=loaded_all_plans,
            )
        )
        self.last_save_reused_plans = reused
        if cfg.cached_metadata:
            if reused or reused_loaded:
                metadata = self.cached_global_metadata
            else:
                self.cached_global_metadata = metadata
            self._cached_central_plan, self._cached_local_plan = central, local

        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        finalizer = _SaveFinalizer(writer, metadata, dist_wrapper, checkpoint_dir, token)
        # If the request is dropped unfinalized (a failed or aborted save), free the directory.
        weakref.finalize(finalizer, _release_dir, checkpoint_dir, token)
        return AsyncRequest(
            save_fn, tuple(save_args or ()), FinalizeFnList([finalizer]), preload_fn=preload_fn
        )

    def _create_writer(self, checkpoint_dir: str) -> FileSystemWriterAsync:
        """Return the storage writer of one save (a hook for subclasses, e.g. test fakes)."""
        cfg = self.config
        return FileSystemWriterAsync(
            checkpoint_dir,
            thread_count=cfg.thread_count,
            sync_files=cfg.sync_files,
            checksums=cfg.checksums,
            separation_hint=cfg.separation_hint,
            is_multiproc_io=cfg.is_multiproc_io,
            use_cached_data_structure=cfg.use_cached_data_structure,
            write_timeout_s=cfg.write_timeout_s,
        )

    def _check_target(self, checkpoint_dir: str, is_coordinator: bool) -> None:
        """Raise if this rank cannot save into ``checkpoint_dir`` (every rank, local)."""
        rank = coordination.get_rank()
        with _in_flight_lock:
            in_flight = checkpoint_dir in _in_flight
        if in_flight:
            raise CheckpointInProgressError(
                f"an earlier save of this process into {checkpoint_dir} is not finalized yet; "
                "finalize it first (AsyncCallsQueue.maybe_finalize_async_calls(blocking=True)) "
                "or save into another directory"
            )
        if not os.path.exists(checkpoint_dir):
            raise CheckpointValidationError(
                f"rank {rank}: checkpoint directory {checkpoint_dir} does not exist; create it "
                "(visible to every rank) before saving"
            )
        if not os.path.isdir(checkpoint_dir):
            raise CheckpointValidationError(
                f"rank {rank}: checkpoint path {checkpoint_dir} is not a directory"
            )
        if not os.access(checkpoint_dir, os.W_OK | os.X_OK):
            raise CheckpointValidationError(
                f"rank {rank}: checkpoint directory {checkpoint_dir} is not writable"
            )
        marker = os.path.join(checkpoint_dir, METADATA_FILE_NAME)
        if is_coordinator and os.path.exists(marker):
            if not self.config.overwrite:
                raise CheckpointValidationError(
                    f"{checkpoint_dir} already holds a complete torch_dist checkpoint ({marker} "
                    "exists) and overwrite=False; save into a new directory or delete it first"
                )
            logger.warning(
                "overwriting the torch_dist checkpoint in %s; its completion markers are removed "
                "first, so it reads as incomplete until this save is finalized",
                checkpoint_dir,
            )
            for name in (METADATA_FILE_NAME, MEGATRON_METADATA_FILE_NAME):
                path = os.path.join(checkpoint_dir, name)
                if os.path.exists(path):
                    os.remove(path)


def register_strategies() -> None:
    """Register :class:`TorchDistAsyncSaveStrategy` as megatron-core's default save
    strategy for the backend name ``'megatron_async'``, version 1.

    Afterwards ``get_default_strategy(StrategyAction.SAVE_SHARDED, 'megatron_async', 1)``
    returns it, and ``dist_checkpointing.save(..., sharded_strategy=('megatron_async', 1))``
    uses it. The checkpoint it writes still says ``torch_dist`` (the format). Creating
    the strategy runs no collective, so this is safe at import time.

    It also installs :class:`~megatron_async.common_guard.GuardedCommonSaveStrategy` as
    megatron-core's ``torch`` common-save strategy: megatron-core writes ``common.pt``
    before any sharded strategy runs, so only a guard at that step can keep a second
    save from replacing the ``common.pt`` of a checkpoint still being written.
    """
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, REGISTERED_BACKEND, 1, TorchDistAsyncSaveStrategy()
    )
    install_common_guard()
