"""How the GPT example's saves are written: the save strategy and the background queue.

Persistent saves go through :class:`~megatron_async.TorchDistAsyncSaveStrategy` (on
megatron-core 0.16.x the class that the registered ``megatron_async`` backend returns; on
0.17+ a subclass of the strategy that ``save()`` keeps), configured from the flags the way
Megatron-LM configures megatron-core's own. With ``--async-save`` its requests, and the
local tier's, run on one :class:`~megatron_async.core.AsyncCallsQueue`.

Both functions run on every rank, in the training thread; ``checkpointing.py`` calls them.
"""

from __future__ import annotations

from typing import Optional

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)

from megatron_async import TorchDistAsyncSaveStrategy
from megatron_async.core import AsyncCallsQueue
from megatron_async.staging.overlapped import refuse_overlap_param_gather
from megatron_async.storage import storage_for

__all__ = ["build_save_strategy", "create_checkpoint_queue"]


def create_checkpoint_queue(args) -> Optional[AsyncCallsQueue]:
    """The queue of background saves for ``--async-save`` (every rank), or None.

    Create it once the process groups exist and before the model is built, as
    Megatron-LM starts its persistent worker right after ``initialize_megatron``: a
    worker forked then shares none of the model's or the optimizer's pages with the
    trainer, so the trainer's updates after the fork copy none of them (a worker forked
    after the model made the next iterations fault on every page of the state).
    """
    if not args.async_save:
        return None
    return AsyncCallsQueue(persistent=args.use_persistent_ckpt_worker)


def build_save_strategy(args, model, optimizer):
    """Build the persistent save strategy from the flags (every rank).

    Build it once per run and reuse it, so that cached plans carry over between saves.

    Args:
        args: the parsed flags (``--save``, ``--ckpt-fully-parallel-save`` ...).
        model: the megatron-core DDP-wrapped model (checked by ``--ckpt-overlap-staging``).
        optimizer: the megatron-core optimizer of ``model`` (likewise).
    """
    # An msc:// --save streams every file to the store from the background writer.
    options = {"use_msc": bool(args.save) and storage_for(args.save).needs_msc}
    if args.ckpt_staging_memory_limit is not None:
        options.update(staging_memory_limit=args.ckpt_staging_memory_limit)
    if args.ckpt_overlap_staging and args.async_save:
        # The copy overlaps the next forward/backward; the optimizer step waits.
        refuse_overlap_param_gather([model, optimizer])
        options.update(overlap_staging=True)
    strategy = TorchDistAsyncSaveStrategy(**options)
    if args.ckpt_assume_constant_structure:
        # Megatron-LM's switch: reuse the first save's plans and metadata while
        # the structure is unchanged (staging buffers are reused by default).
        strategy.use_cached_ckpt_structure = True
    if args.ckpt_fully_parallel_save:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy,
            parallel_state.get_data_parallel_group(with_context_parallel=True),
            args.ckpt_assume_constant_structure,
        )
    return strategy
