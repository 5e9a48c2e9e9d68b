"""nvidia-resiliency-ext's ``LocalCheckpointManager`` on our async machinery.

Megatron-LM's ``--non-persistent-ckpt-type local`` builds one manager per rank and calls
``save`` every ``--non-persistent-save-interval`` iterations, then ``find_latest`` and
``load`` (twice each) when it restarts. The names, arguments and return values are
nvidia-resiliency-ext's; what differs is where the work runs and what is checked:

* ``save`` (every rank, training thread) only stages the state dict, a ``torch.save`` of
  the ``TensorAwareStateDict`` within the staging budget, and returns our
  :class:`~megatron_async.core.request.AsyncRequest`. Writing the part and replicating it
  to the clique peers run in the background writer (:mod:`.part_writer`); each part and
  replica is hashed and recorded (:mod:`.parts`). The caller's state dict is left whole.
* Finalize (every rank, once the queue agreed that every rank's writer succeeded, so
  every part and every replica is durable) makes the iteration the kept one
  (:mod:`.retention`); the next save's writer removes the older iterations of this
  rank's holder directory before writing (unlinking is not the training thread's work).
  A failed save leaves the previous iteration in place; its own files go at once, or at
  the start of the next save.
* ``find_latest`` and ``load`` (every rank) are one agreed recovery (:mod:`.recover`):
  the newest iteration whose every part has a verified copy somewhere, the missing parts
  moved between ranks as whole byte blobs, nothing deserialized before its digest checks.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import secrets
from pathlib import Path
from typing import Any, Optional, Tuple, Union

import torch

from megatron_async.core import coordination
from megatron_async.core.config import STAGING_WAIT_S
from megatron_async.core.request import AsyncRequest, require_hand_over, run_preload
from megatron_async.errors import (
    CheckpointingException,
    LocalSaveFailedError,
    RankFailure,
    SameMachineReplicationException,
)
from megatron_async.local import parts, recover, transport
from megatron_async.local.cliques import LazyReplicationStrategyBuilder, ReplicationStrategy
from megatron_async.local.exchange import ForgetPublishedKey, PeerExchange
from megatron_async.local.part_writer import LocalSaveJob, write_local_part
from megatron_async.local.retention import FinalizeLocalSave, LocalRetention
from megatron_async.local.state_dict import TensorAwareStateDict
from megatron_async.staging.budget import StagingBufferCache, validate_staging_memory_limit
from megatron_async.staging.torch_save import TorchSaveStaged, stage_torch_save

__all__ = [
    "LocalCheckpointManager",
    "CkptID",
    "RUN_ID_ENV",
    "CheckpointingException",
    "SameMachineReplicationException",
]

logger = logging.getLogger(__name__)

CkptID = Tuple[int, int, Any]
"""``(iteration, rank, session_id)``: what ``load`` returns beside the state dict."""

RUN_ID_ENV = "MEGATRON_ASYNC_RUN_ID"
"""The job's run id when none is passed: parts of another run id are never recovered."""


class LocalCheckpointManager:
    """Save local checkpoints to node-local storage, replicated to peers; recover them.

    Every rank constructs one with the same arguments (after ``torch.distributed`` is
    initialized) and calls ``save``, ``find_latest`` and ``load`` at the same points:
    they run collectives over the coordination group
    (:func:`~megatron_async.core.coordination.get_coordination_group`). Nothing touches
    the disk before the first of them.

    Args:
        root_local_ckpt_dir: node-local directory; this rank's holder directory is
            ``root/<session_id>/<rank>``.
        session_id: a sub-directory of the root (nvidia-resiliency-ext's argument).
        repl_strategy: where replicas are kept
            (``CliqueReplicationStrategy.from_replication_params(J, F)``); None keeps each
            part only on its owner.
        run_id: the job's name, recorded with every part; parts of another run id are
            ignored at recovery (None: ``MEGATRON_ASYNC_RUN_ID``, default ``''``).
        algo: ``"fully_parallel"`` or ``"atomic"``, recorded and compared when known.
        staging_memory_limit: the most host memory this process's staged tensors may hold
            at once, as for :class:`~megatron_async.torch_ckpt.TorchAsyncCheckpoint`.
    """

    def __init__(
        self,
        root_local_ckpt_dir: Union[str, os.PathLike],
        session_id: str = "",
        repl_strategy: Optional[ReplicationStrategy] = None,
        *,
        run_id: Optional[str] = None,
        algo: Optional[str] = None,
        staging_memory_limit: Union[int, float, None] = None,
    ):
        validate_staging_memory_limit(staging_memory_limit)
        self.root_local_ckpt_dir = root_local_ckpt_dir
        self.session_id = session_id
        self.repl_strategy = repl_strategy
        self.run_id = os.environ.get(RUN_ID_ENV, "") if run_id is None else run_id
        self.algo = algo
        self.staging_memory_limit = staging_memory_limit
        self.latest_iteration = -1
        """The iteration ``find_latest`` found (cached for Megatron-LM's second call); -1
        before it, and again once a save starts."""
        self.recovered_from: Optional[int] = None
        """The holder whose copy of this rank's part ``find_latest`` recovered: this rank
        (its own part) or the peer whose replica it received (and wrote back); None when
        nothing was recovered, and again once a save starts."""
        self.staging_stats: dict = {}
        """``rounds`` and ``peak_bytes`` of the latest save's staging."""
        self.staging_cache = StagingBufferCache()  # this rank's segment, kept between saves
        self._rank: Optional[int] = None
        self._token: Optional[str] = None
        self._saves = 0
        self._retention: Optional[LocalRetention] = None
        self._recovered: Optional[recover.Recovered] = None

    # -- where ------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's global rank (0 without ``torch.distributed``)."""
        if self._rank is None:
            self._rank = coordination.get_rank()
        return self._rank

    @property
    def local_ckpt_dir(self) -> Path:
        """This rank's holder directory (created by the first save)."""
        return Path(parts.holder_dir(self.root_local_ckpt_dir, self.session_id, self.rank))

    @property
    def retention(self) -> LocalRetention:
        """Which iterations this rank's holder directory keeps (every rank)."""
        if self._retention is None:
            self._retention = LocalRetention(os.fspath(self.local_ckpt_dir), self.rank)
        return self._retention

    def identity(self) -> parts.LocalIdentity:
        """The job's identity recorded with every part (world size, J, F, run id, algo)."""
        strategy = self.repl_strategy
        if isinstance(strategy, LazyReplicationStrategyBuilder):
            strategy = strategy.replication_strategy
        jump = getattr(strategy, "replication_jump", None)
        factor = getattr(strategy, "replication_factor", 1) if strategy is not None else 1
        return parts.LocalIdentity(
            coordination.get_world_size(), jump, factor, self.run_id, self.algo
        )

    # -- save -------------------------------------------------------------------------

    def save(
        self, state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False
    ) -> Optional[AsyncRequest]:
        """Save this rank's part of ``iteration`` (every rank, training thread).

        Stages a ``torch.save`` of ``state_dict`` within the staging budget: when it fits,
        every tensor is copied before this returns and the caller may change them at once;
        above the budget the later rounds copy once the request is scheduled, so schedule
        it before changing them (Megatron-LM does, at once). GPU tensors are recorded on
        their device and load back there. ``state_dict`` itself is not changed.

        Args:
            state_dict: this rank's ``TensorAwareStateDict`` (megatron-core's
                ``MCoreTensorAwareStateDict``, or ``BasicTensorAwareStateDict``).
            iteration: the training iteration; larger than the last one saved or recovered.
            is_async: return the request for ``AsyncCallsQueue.schedule_async_request``
                instead of saving here.

        Returns:
            The request (``is_async``), whose finalize step makes ``iteration`` the kept
            one; else None, after the save is written, replicated and finalized on every
            rank.

        Raises:
            CheckpointingException: ``iteration`` is not above every iteration saved or
                recovered before, or replication has no job TCPStore to meet in (it is
                :class:`~megatron_async.errors.LocalCheckpointError`).
            LocalSaveFailedError: on every rank, when staging failed on any rank (and,
                synchronously, when writing or replicating failed); the previous local
                checkpoint is intact. It is an ``AsyncSaveFailedError`` and
                nvidia-resiliency-ext's ``CheckpointingException``; the queue raises it
                too when an asynchronous save fails.
        """
        retention = self.retention
        floor = retention.floor()
        if not isinstance(iteration, int) or iteration < 0 or iteration <= floor:
            raise CheckpointingException(
                f"rank {self.rank}: local checkpoint iteration {iteration!r} must be a "
                f"non-negative int above the last one saved or recovered ({floor})"
            )
        self.latest_iteration = -1
        self._recovered = None
        self.recovered_from = None
        self._saves += 1
        token = self._job_token()
        directory = retention.directory
        retention.remove_failed_saves(iteration)
        exchange = self._exchange(token, iteration, directory)
        job = LocalSaveJob(
            directory=directory, iteration=iteration, rank=self.rank,
            identity=self.identity(), exchange=exchange, staging_wait_s=STAGING_WAIT_S,
            remove_below=retention.kept,
        )
        staged = self._stage(state_dict, iteration)
        request = AsyncRequest(
            async_fn=write_local_part,
            async_fn_args=(job, None),
            finalize_fns=[
                FinalizeLocalSave(retention, iteration, staged, self.staging_stats),
                *([ForgetPublishedKey(exchange, self.rank)] if exchange is not None else []),
            ],
            preload_fn=functools.partial(_staged, staged),
        )
        retention.started(iteration)
        if is_async:
            return request
        request.execute_sync()
        return None

    def _stage(self, state_dict: Any, iteration: int) -> TorchSaveStaged:
        """Stage on this rank and agree that every rank did (every rank): a rank that
        could not would otherwise leave its peers' writers waiting for its part."""
        self.staging_stats = {}
        stage = functools.partial(
            stage_torch_save, state_dict, pickle, torch.serialization.DEFAULT_PROTOCOL, True,
            self.staging_memory_limit, STAGING_WAIT_S, self.staging_stats, device_locations=True,
            cache=self.staging_cache, crc32=False,  # the part's xxh3 digest covers every byte
        )
        staged, failure = None, None
        try:
            staged = run_preload(stage)
        except Exception as exc:  # agreed on below
            logger.error(
                "rank %d: staging local checkpoint %d failed: %s", self.rank, iteration, exc
            )
            failure = RankFailure.from_exception(self.rank, "staging", exc)
        try:
            name = self._name(iteration)
            coordination.agree(
                failure, lambda found: LocalSaveFailedError({f.rank: f for f in found}, name)
            )
        except BaseException:
            if staged is not None:
                staged.release()
            raise
        return staged

    def _exchange(self, token: str, iteration: int, directory: str) -> Optional[PeerExchange]:
        if self.repl_strategy is None:
            return None
        peers = self.repl_strategy.peers(self.rank)
        if not peers:
            return None
        host, port = transport.store_address(required=True)
        return PeerExchange(
            store_host=host, store_port=port,
            key_prefix=f"megatron_async/local/{token}/{iteration}/{self._saves}",
            session_id=self.session_id, peers=peers, directory=directory,
            timeout_s=coordination.coordination_timeout_s(),
        )

    def _job_token(self) -> str:
        """A token naming this job in the store, chosen by rank 0 and shared at the first
        collective use (every rank)."""
        if self._token is None:
            proposal = secrets.token_hex(8) if self.rank == 0 else None
            self._token = coordination.all_gather_objects(proposal)[0]
        return self._token

    def _name(self, iteration: int) -> str:
        return os.path.join(os.fspath(self.local_ckpt_dir), parts.part_name(iteration, self.rank))

    # -- recovery ---------------------------------------------------------------------

    def find_latest(self) -> int:
        """The newest local iteration every rank can recover, or -1 (every rank).

        One agreed decision (:func:`~megatron_async.local.recover.recover_newest`): parts
        of another job are ignored, every part used is verified against its digest, a
        missing or damaged part is taken from a peer's intact replica, else the next older
        iteration is tried. A part received from a peer arrives straight in this rank's
        holder directory and is written back (made durable, with its record) before the
        ranks agree; a rank that cannot write it back ends the recovery on every rank
        (-1). Memory: no part is copied into the process: verifying streams through one
        8 MiB buffer, and parts move from and into mappings of their files (page cache);
        every rank keeps only the record of its verified copy and its file's version; a
        second call returns the cached answer. The ranks must agree on the identity (a
        ``run_id`` or ``algo`` passed on some ranks only): else every rank logs both and
        returns -1.

        Each rank logs which copy it recovered (INFO) and keeps its holder in
        :attr:`recovered_from`.

        Raises:
            CheckpointingException: a save of this manager is still in flight: finalize
                it first (``maybe_finalize_async_calls(blocking=True)``); its writer may
                remove what a recovery would choose.
        """
        if self.latest_iteration != -1:
            return self.latest_iteration
        if self.retention.in_flight:
            raise CheckpointingException(
                f"rank {self.rank}: local checkpoint save(s) of iteration(s) "
                f"{sorted(self.retention.in_flight)} are still in flight: finalize them "
                "(maybe_finalize_async_calls(blocking=True)) before find_latest()"
            )
        self._job_token()
        self._recovered = recover.recover_newest(
            os.fspath(self.local_ckpt_dir), self.identity(), self.rank
        )
        if self._recovered is not None:
            self.latest_iteration = self._recovered.iteration
            self.recovered_from = self._recovered.source
            self.retention.recovered(self.latest_iteration)
            logger.info(
                "rank %d: local checkpoint %d recovered from %s", self.rank,
                self.latest_iteration, self._recovered.describe(),
            )
        return self.latest_iteration

    def load(self) -> Tuple[TensorAwareStateDict, CkptID]:
        """This rank's state dict of the iteration :meth:`find_latest` found (every rank).

        Maps this rank's verified copy on disk (``torch.load(mmap=True)``: CPU tensors
        share the file's page-cache pages, copy-on-write, instead of a copy of the part),
        its own part or the one received from a peer and written back alike. The file is
        hashed again only if it changed since :meth:`find_latest` verified it (its
        device, inode, size, modification or status-change time differ), and a file
        changed while it was loaded is refused (until ``load`` returns; the mapped
        tensors read the file's pages when first touched, and the library never
        rewrites a part in place).
        A second call moves nothing between ranks. Tensors are back on their devices.

        Returns:
            ``(state dict, (iteration, rank, session_id))``.

        Raises:
            CheckpointingException: no local checkpoint was found (call ``find_latest``
                first; it returned -1), or its verified copy changed since and no longer
                hashes to its digest (or changed while it was loaded).
        """
        if self._recovered is None:
            raise CheckpointingException(
                f"rank {self.rank}: no local checkpoint to load: call find_latest() first, "
                "and load only when it returned an iteration (not -1)"
            )
        state, self._recovered = recover.deserialize(self._recovered)
        return state, (self._recovered.iteration, self.rank, self.session_id)

    def __repr__(self) -> str:
        return (
            f"LocalCheckpointManager(root_local_ckpt_dir={self.root_local_ckpt_dir!r}, "
            f"session_id={self.session_id!r}, repl_strategy={self.repl_strategy!r})"
        )


def _staged(staged: TorchSaveStaged) -> TorchSaveStaged:
    """``preload_fn`` of a local save: the data ``save`` staged already (trainer).

    Raises:
        StagingHandOverError: the state was staged in rounds and another library's queue
            runs this request (its writer would wait for rounds nobody hands over); the
            staging memory is given back.
    """
    if staged.gate.in_rounds:
        try:
            require_hand_over(
                "a local checkpoint staged in rounds through the staging_memory_limit",
                "raise the LocalCheckpointManager's staging_memory_limit to one copy of the state",
            )
        except BaseException:
            staged.release()
            raise
    return staged
