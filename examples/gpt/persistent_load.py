"""Resume the GPT example from a persistent checkpoint: the checks, then the load.

Before any shard is read, every rank checks that this run can take the checkpoint: with
``--ckpt-verify-on-load`` its files re-hash to their digests, it holds what the load flags
ask for (optimizer, RNG states), its RNG states fit this run's layout and version, and
megatron-core can reshard its optimizer state into this run's parallel layout
(``resharding.py``). Its content metadata then selects the format of the load template,
and the loaded state goes into the :class:`~gpt.training_state.TrainingState`.

A check that fails stops the job with the flag to use. Runs on every rank, in the
training thread; :meth:`gpt.checkpointing.Checkpointer.load` calls it once it has chosen
the persistent tier.
"""

from __future__ import annotations

from typing import Any, Dict

from megatron.core import dist_checkpointing

from gpt.resharding import (
    LEGACY_DISTRIBUTED_OPTIMIZER_METADATA,
    ParallelLayout,
    check_optimizer_resume,
)
from gpt.training_state import CHECKPOINT_VERSION, TrainingState
from megatron_async.errors import CheckpointIntegrityError
from megatron_async.integrity.verify import verify_checkpoint_integrity

__all__ = ["load_persistent_checkpoint"]


def load_persistent_checkpoint(args, state: TrainingState, path: str) -> Dict[str, Any]:
    """Check that this run can resume from the checkpoint at ``path``, then load it.

    Args:
        args: the parsed flags (``--no-load-optim``, ``--no-load-rng``,
            ``--ckpt-verify-on-load``, ``--use-distributed-optimizer``).
        state: the training state to load into.
        path: the persistent checkpoint's directory.

    Returns:
        The checkpoint's common state dict (``iteration``, ``consumed_samples`` ...).

    Raises:
        SystemExit: the checkpoint is damaged or this run cannot take it; the message
            names the flag to use.
    """
    if args.ckpt_verify_on_load:
        # Before reading anything: damaged bytes could otherwise load silently.
        try:
            verify_checkpoint_integrity(path)
        except CheckpointIntegrityError as exc:
            raise SystemExit(
                f"{exc}\nTo resume from an older one, pass --ckpt-step ITERATION."
            ) from exc
    common = dist_checkpointing.load_common_state_dict(path)
    content = common["content"]
    with_optimizer = not args.no_load_optim
    with_rng = not args.no_load_rng
    if with_optimizer and not content["optimizer"]:
        raise SystemExit(f"{path} was saved with --no-save-optim; "
                         "pass --no-load-optim to resume without optimizer state")
    if with_rng and not content["rng"]:
        raise SystemExit(f"{path} was saved with --no-save-rng; "
                         "pass --no-load-rng to resume with fresh RNG states")
    saved_layout = ParallelLayout.from_dict(content["layout"])
    layout = ParallelLayout.current()
    if with_rng and saved_layout != layout:
        raise SystemExit(f"{path} was saved with {saved_layout}, this run is {layout}; "
                         "RNG states are per rank: pass --no-load-rng")
    if with_rng and common.get("checkpoint_version", 1) < CHECKPOINT_VERSION:
        raise SystemExit(f"{path} was written by an older version of this example, "
                         "whose RNG records this one cannot read: pass --no-load-rng")
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if metadata is None:
        metadata = (dict(LEGACY_DISTRIBUTED_OPTIMIZER_METADATA)
                    if args.use_distributed_optimizer else {})
    if with_optimizer:
        check_optimizer_resume(path, metadata, saved_layout, layout,
                               args.use_distributed_optimizer)
    state.prepare_load(with_optimizer)
    template = state.sharded_state_dict(
        0, 0, metadata, is_loading=True, with_optimizer=with_optimizer, with_rng=with_rng
    )
    state_dict = dist_checkpointing.load(template, path)
    state.apply(state_dict, with_optimizer=with_optimizer, with_rng=with_rng)
    return common
