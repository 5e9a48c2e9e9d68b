"""The local checkpoint tier: Megatron-LM's ``--non-persistent-ckpt-type local``.

Between persistent checkpoints, every ``--non-persistent-save-interval`` iterations, each
rank saves its part of the training state to node-local storage
(``--non-persistent-local-ckpt-dir``) through nvidia-resiliency-ext's
``LocalCheckpointManager``, served by :mod:`megatron_async.nvrx`; with ``--replication``
the background writer also sends it to its clique peers (``--replication-jump``,
``--replication-factor``), so the parts of a lost node survive on other nodes. The calls
are Megatron-LM's (``megatron/training/checkpointing.py``): the state goes in as
megatron-core's ``MCoreTensorAwareStateDict.from_state_dict`` of the same sharded state
dict the persistent tier saves, and comes back through ``find_latest``, ``load`` and
``to_state_dict``. With ``fully_parallel`` (the default) each data-parallel rank saves
only its share of the replicated tensors and megatron-core exchanges them at load time,
on the GPU, or on a CPU-only host through the patches of ``cpu_compat.py``.

Every function and method here runs on every rank, in the training thread, at the same
points (the manager's calls are collective).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from megatron.core import parallel_state

from megatron_async.errors import AsyncSaveFailedError
from megatron_async.manager import TooManySaveFailuresError

from gpt.resharding import ParallelLayout
from gpt.training_state import TrainingState

__all__ = ["LocalCheckpointer", "serve_local_checkpointing"]

logger = logging.getLogger(__name__)


def serve_local_checkpointing() -> None:
    """Serve nvidia-resiliency-ext's ``checkpointing.local`` from megatron_async (every
    rank, before megatron-core's ``tensor_aware_state_dict`` is first imported: it picks
    its base class then)."""
    from megatron_async.nvrx import serve_as_nvidia_resiliency_ext

    serve_as_nvidia_resiliency_ext()


def _data_parallel_group():
    """Megatron-LM's ``parallelization_group``: the data-parallel group with context parallelism."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


class LocalCheckpointer:
    """Save the training state to the local tier and load it back.

    Args:
        args: the parsed flags (``--non-persistent-*``, ``--replication*``,
            ``--async-save``, ``--ckpt-staging-memory-limit``).
        state: the training state both tiers save.
        content_metadata: this run's format of the state (the persistent tier's content
            metadata); a local checkpoint is only read back by a run with the same flags.
    """

    def __init__(self, args, state: TrainingState, content_metadata: Dict[str, Any]):
        # Megatron-LM's imports, resolved to megatron_async by serve_local_checkpointing().
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
            CliqueReplicationStrategy,
        )

        self.args = args
        self.state = state
        self.content_metadata = content_metadata
        self.algo = args.non_persistent_local_ckpt_algo
        repl_strategy = None
        if args.replication:
            # Collective: every rank creates every clique's process group.
            repl_strategy = CliqueReplicationStrategy.from_replication_params(
                args.replication_jump, args.replication_factor
            )
        self.manager = LocalCheckpointManager(
            args.non_persistent_local_ckpt_dir, repl_strategy=repl_strategy, algo=self.algo,
            staging_memory_limit=args.ckpt_staging_memory_limit,
        )
        self.consecutive_failures = 0
        self.distribution = None
        """megatron-core's distribution of the last save (which rank saves which
        replicated tensor), reused with --ckpt-assume-constant-structure as Megatron-LM
        does: the next save then skips the validation and the distribution's gathers."""

    def save(self, iteration: int, consumed_samples: int):
        """Stage this rank's part of ``iteration``; return the request to schedule
        (``--async-save``), or None once it is written and replicated everywhere."""
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import (
            MCoreTensorAwareStateDict,
        )

        args = self.args
        sharded_state_dict = self.state.sharded_state_dict(
            iteration, consumed_samples, self.content_metadata, is_loading=False,
            with_optimizer=not args.no_save_optim, with_rng=not args.no_save_rng,
        )
        cached = self.distribution if args.ckpt_assume_constant_structure else None
        tasd, self.distribution = MCoreTensorAwareStateDict.from_state_dict(
            sharded_state_dict, algo=self.algo, parallelization_group=_data_parallel_group(),
            cached_metadata=cached,
        )
        return self.manager.save(tasd, iteration, is_async=bool(args.async_save))

    def saved(self) -> None:
        """A local save is durable everywhere: the failure count starts again."""
        self.consecutive_failures = 0

    def save_failed(self, iteration: int, error: BaseException) -> None:
        """Apply ``--ckpt-save-failure`` to a failed local save (every rank): raise, or log
        it and go on (the previous local checkpoint is intact and still recovers).

        Local saves are counted apart from persistent ones, against the same
        ``--ckpt-max-consecutive-save-failures``.
        """
        args = self.args
        if args.ckpt_save_failure == "raise" or not isinstance(error, AsyncSaveFailedError):
            raise error
        self.consecutive_failures += 1
        if self.consecutive_failures >= args.ckpt_max_consecutive_save_failures:
            raise TooManySaveFailuresError(
                error.rank_failures, error.checkpoint,
                hint=f"{self.consecutive_failures} local checkpoint saves failed in a row, the "
                "most --ckpt-max-consecutive-save-failures allows; the job stops.",
            ) from error
        logger.error("local checkpoint of iteration %d failed (%d in a row); training goes on "
                     "and the previous local checkpoint still recovers:\n%s",
                     iteration, self.consecutive_failures, error)

    def find_latest(self) -> int:
        """The newest local iteration whose every part is intact somewhere, or -1."""
        return self.manager.find_latest()

    def load(self) -> Dict[str, Any]:
        """Load the iteration :meth:`find_latest` found into model, optimizer and RNGs;
        return the loaded state dict (its plain values: ``iteration``, ``consumed_samples``)."""
        args = self.args
        with_optimizer, with_rng = not args.no_load_optim, not args.no_load_rng
        tasd, _ = self.manager.load()
        common = tasd.to_state_dict(None, algo=self.algo)
        content = common["content"]
        if with_optimizer and not content["optimizer"]:
            raise SystemExit("the local checkpoint was saved with --no-save-optim; "
                             "pass --no-load-optim to resume without optimizer state")
        if with_rng and not content["rng"]:
            raise SystemExit("the local checkpoint was saved with --no-save-rng; "
                             "pass --no-load-rng to resume with fresh RNG states")
        saved_layout = ParallelLayout.from_dict(content["layout"])
        if saved_layout != ParallelLayout.current():
            raise SystemExit(f"the local checkpoint was saved with {saved_layout}, this run is "
                             f"{ParallelLayout.current()}: a local checkpoint resumes only the "
                             "layout that saved it (resume from the persistent one instead)")
        self.state.prepare_load(with_optimizer)
        template = self.state.sharded_state_dict(
            0, 0, self.content_metadata, is_loading=True,
            with_optimizer=with_optimizer, with_rng=with_rng,
        )
        state_dict = tasd.to_state_dict(
            template, algo=self.algo, parallelization_group=_data_parallel_group()
        )
        self.state.apply(state_dict, with_optimizer=with_optimizer, with_rng=with_rng)
        return state_dict

    def holder_bytes(self) -> Optional[int]:
        """Bytes in this rank's holder directory (its parts and the replicas it keeps)."""
        directory = self.manager.local_ckpt_dir
        if not directory.is_dir():
            return None
        return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
