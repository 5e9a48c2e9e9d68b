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
from typing import Any, Dict, List, Optional, Tuple, Union

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
from megatron_async._plan_reuse import (
    PlanBinding,
    Structure,
    bind_plan,
    describe_structure,
    rebind,
)
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
    prepare_cached_write,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)

__all__ = [
    "TorchDistSaveConfig",
    "TorchDistAsyncSaveStrategy",
    "REGISTERED_BACKEND",
    "register_strategies",
    "checkpoint_dirs_in_flight",
    "get_structure_reuse_count",
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
    change (verified on every save with one small all-reduce): no plan gather then, and
    no local planning either while the sharded state dict's fingerprint is unchanged."""

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


_reuse_lock = threading.Lock()
_structure_reuse_count = 0


def get_structure_reuse_count() -> int:
    """How many saves of this process reused the previous save's plan without planning.

    Such a save found its sharded state dict's fingerprint unchanged, as did every other
    rank: it skipped megatron-core's translation, the local plan and the bucket layout.
    """
    return _structure_reuse_count


def _count_structure_reuse() -> None:
    global _structure_reuse_count
    with _reuse_lock:
        _structure_reuse_count += 1


@dataclasses.dataclass(frozen=True)
class _PlanCache:
    """What the next save of a strategy may reuse from its latest one (every rank, its own).

    Attributes:
        config: the options it was planned with; a save with other options plans afresh.
        world: ``(rank, world size)`` it was planned in.
        metadata: the global metadata on the coordinator (elsewhere whatever the strategy's
            ``cached_global_metadata`` was); reused only while it is still that object.
        central_plan: this rank's final plan.
        local_plan: this rank's local plan, compared with a fresh one when the
            fingerprint changed.
        fingerprint: the structure of the state dict it was planned for, or None.
        binding: where the plan's items take their data from, or None (no reuse without
            planning).
    """

    config: TorchDistSaveConfig
    world: Tuple[int, int]
    metadata: Optional[Metadata]
    central_plan: SavePlan
    local_plan: SavePlan
    fingerprint: Optional[List[tuple]]
    binding: Optional[PlanBinding]


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

    With ``cached_metadata``, a save whose sharded state dict has the same fingerprint as
    the previous save's (keys, shapes, offsets, dtypes, replica ids, ... of every
    ShardedTensor and ShardedObject) on every rank skips planning altogether: it binds the
    new tensors, and the freshly serialized ShardedObjects, to the previous save's write
    items (see :mod:`megatron_async._plan_reuse`). A change on any rank makes every rank
    plan again.
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
        self._plan_cache: Optional[_PlanCache] = None
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
        cache = self._usable_cache(is_coordinator)
        structure: Optional[Structure] = None
        prepared, pyt_state_dict, error = None, None, None
        try:
            self._check_target(checkpoint_dir, is_coordinator)
            if self.config.cached_metadata:
                structure = self._describe(sharded_state_dict, cache)
            if (
                cache is not None
                and cache.binding is not None
                and structure is not None
                and structure.fingerprint is cache.fingerprint
            ):
                prepared = self._prepare_from_cache(cache, structure, checkpoint_dir)
            else:
                pyt_state_dict = self._translate(sharded_state_dict)
        except Exception as exc:  # agreed on below, so that no rank waits for a failed one
            error = exc
        # The one collective of a save with an unchanged structure: did any rank fail, did
        # any rank's structure change, did any rank prepare a reuse?
        changed, any_prepared = agree_or_raise(
            error,
            f"async save to {checkpoint_dir}",
            [int(prepared is None), int(prepared is not None)],
            group,
        )

        token = _claim_dir(checkpoint_dir)
        try:
            if not changed:
                return self._reuse(prepared, cache, checkpoint_dir, token)
            if any_prepared:  # planning in full after all: translate where it was skipped
                error = None
                try:
                    if pyt_state_dict is None:
                        pyt_state_dict = self._translate(sharded_state_dict)
                except Exception as exc:  # agreed on below
                    error = exc
                agree_or_raise(error, f"translating the state dict for {checkpoint_dir}", (), group)
            return self._plan(pyt_state_dict, structure, cache, checkpoint_dir, token)
        except BaseException:
            _release_dir(checkpoint_dir, token)
            raise

    def _translate(self, sharded_state_dict: ShardedStateDict) -> Dict[str, Any]:
        """megatron-core's translation into a PyTorch DCP state dict (every rank, local)."""
        flat_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.config.keep_only_main_replica
        )
        return mcore_to_pyt_state_dict(flat_state_dict, False)

    def _describe(
        self, sharded_state_dict: ShardedStateDict, cache: Optional[_PlanCache]
    ) -> Optional[Structure]:
        """Fingerprint the state dict against the cached one (every rank, local)."""
        try:
            return describe_structure(
                sharded_state_dict, cache.fingerprint if cache is not None else None
            )
        except Exception:  # an optimization only: what it cannot describe is planned in full
            logger.debug(
                "rank %d: cannot fingerprint the sharded state dict; planning in full",
                coordination.get_rank(),
                exc_info=True,
            )
            return None

    def _usable_cache(self, is_coordinator: bool) -> Optional[_PlanCache]:
        """Return the latest save's plans if this save may reuse them (every rank, local)."""
        cache = self._plan_cache
        if cache is None or not self.config.cached_metadata or cache.config != self.config:
            return None
        if cache.world != (coordination.get_rank(), coordination.get_world_size()):
            return None
        # Replaced by the user (a loaded checkpoint's metadata, for instance): that
        # metadata is verified against fresh plans instead.
        if cache.metadata is not self.cached_global_metadata:
            return None
        if is_coordinator and cache.metadata is None:
            return None  # without metadata to reuse, force a fresh plan on every rank
        return cache

    def _prepare_from_cache(self, cache: _PlanCache, structure: Structure, checkpoint_dir: str):
        """Bind this save's data to the cached plan and prepare its writer (every rank, local)."""
        binding = cache.binding
        return prepare_cached_write(
            self._create_writer(checkpoint_dir),
            cache.central_plan,
            rebind(binding, structure),
            binding.layout,
            binding.staging_key,
            coordinator_rank=_COORDINATOR_RANK,
        )

    def _reuse(self, prepared, cache: _PlanCache, checkpoint_dir: str, token: int) -> AsyncRequest:
        """Finish a save that every rank prepared from its cache."""
        writer, dist_wrapper = prepared
        _count_structure_reuse()
        self.last_save_reused_plans = True
        logger.debug(
            "rank %d: structure unchanged on every rank; reusing the plan without planning",
            dist_wrapper.rank,
        )
        return self._request(writer, cache.metadata, dist_wrapper, checkpoint_dir, token)

    def _plan(
        self,
        pyt_state_dict,
        structure: Optional[Structure],
        cache: Optional[_PlanCache],
        checkpoint_dir: str,
        token: int,
    ) -> AsyncRequest:
        """Plan the save in full (every rank), reusing verified plans where it can."""
        cfg = self.config
        self._plan_cache = None  # until this planning succeeds: never keep an older one
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
                    (cache.central_plan, cache.local_plan, True) if cache is not None else None
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
            self._plan_cache = _PlanCache(
                config=cfg,
                world=(coordination.get_rank(), coordination.get_world_size()),
                metadata=metadata,
                central_plan=central,
                local_plan=local,
                fingerprint=structure.fingerprint if structure is not None else None,
                binding=self._bind(structure, central, writer),
            )
        return self._request(writer, metadata, dist_wrapper, checkpoint_dir, token)

    def _bind(
        self, structure: Optional[Structure], central: SavePlan, writer: FileSystemWriterAsync
    ) -> Optional[PlanBinding]:
        """Bind the plan to the structure, for the next saves (every rank, local)."""
        if structure is None:
            return None
        try:
            return bind_plan(
                structure,
                central,
                writer.write_buckets,
                writer.bucket_layout,
                writer.staging_key,
                self.config.keep_only_main_replica,
            )
        except Exception:  # an optimization only: this save goes on, the next ones plan in full
            logger.warning(
                "rank %d: cannot bind the plan to the state dict's structure; later saves "
                "plan in full",
                coordination.get_rank(),
                exc_info=True,
            )
            return None

    def _request(
        self, writer, metadata, dist_wrapper, checkpoint_dir: str, token: int
    ) -> AsyncRequest:
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
