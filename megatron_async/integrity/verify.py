"""Opt-in integrity check of a checkpoint before loading it (every rank).

Call :func:`verify_checkpoint_integrity` on every rank right before
``dist_checkpointing.load``. Each rank re-hashes its share of the data files (files
are dealt round-robin, so the work and the reads are spread over the job), and any
damage found anywhere raises the same :class:`CheckpointIntegrityError` on every rank,
naming the damaged file and item.
"""

from __future__ import annotations

import logging
import pickle
from typing import List, Optional

import torch.distributed as dist

from megatron_async.integrity import checksums
from megatron_async.core import coordination
from megatron_async.errors import CheckpointIntegrityError
from megatron_async.integrity.inspection import find_completeness_problems
from megatron_async.storage.backend import storage_for

__all__ = ["verify_checkpoint_integrity"]

logger = logging.getLogger(__name__)


def _local_problems(checkpoint_dir: str, require_checksums: bool, rank: int, world_size: int) -> List[str]:
    problems: List[str] = []
    if rank == 0:
        problems += find_completeness_problems(checkpoint_dir)
    try:
        items = checksums.read_checksums(checkpoint_dir)
    except (OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError, EOFError) as exc:
        return problems + [f"the checksum records cannot be read: {exc}"]
    if items is None:
        if require_checksums and rank == 0:
            problems.append(
                "no checksum records: the checkpoint was saved without checksums "
                "(TorchDistSaveConfig.checksums=False or another writer)"
            )
        return problems
    by_file = checksums.group_by_file(items)
    my_files = sorted(by_file)[rank::world_size]
    for name in my_files:
        problems += checksums.verify_items(checkpoint_dir, by_file[name])
    return problems


def verify_checkpoint_integrity(
    checkpoint_dir: str,
    *,
    require_checksums: bool = False,
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Check completeness and recorded checksums of ``checkpoint_dir`` (every rank).

    Args:
        checkpoint_dir: the checkpoint directory (readable by every rank).
        require_checksums: treat a checkpoint without recorded checksums as damaged.
        group: the group that shares the work; defaults to the coordination group.

    Raises:
        CheckpointIntegrityError: on every rank, when any rank found a problem; the
            message lists each damaged file and item.
    """
    rank = dist.get_rank(group) if coordination.is_distributed() else 0
    world_size = dist.get_world_size(group) if coordination.is_distributed() else 1
    if not storage_for(checkpoint_dir).is_dir(checkpoint_dir):
        raise CheckpointIntegrityError(f"{checkpoint_dir} is not a directory; nothing to load")
    try:
        problems = _local_problems(checkpoint_dir, require_checksums, rank, world_size)
    except OSError as exc:
        problems = [f"reading {checkpoint_dir} failed on rank {rank}: {exc}"]
    (any_problem,) = coordination.all_reduce_max([int(bool(problems))], group)
    if not any_problem:
        logger.debug("rank %d: %s passed the integrity check", rank, checkpoint_dir)
        return
    everyone = coordination.all_gather_objects(problems, group)
    lines = [f"rank {r}: {p}" for r, rank_problems in enumerate(everyone) for p in rank_problems]
    raise CheckpointIntegrityError(
        f"checkpoint {checkpoint_dir} is damaged ({len(lines)} problem(s)):\n  "
        + "\n  ".join(lines)
        + "\nLoad an older complete checkpoint (python -m megatron_async list SAVE_DIR)."
    )
