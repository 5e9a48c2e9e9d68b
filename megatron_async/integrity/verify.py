"""Check a checkpoint's completeness and recorded checksums: ``verify`` and the load-time check.

:func:`find_damage` runs in one process (the ``verify`` command checks everything).
:func:`verify_checkpoint_integrity`, the opt-in check, runs on every rank right before
``dist_checkpointing.load``: each rank re-hashes its share of the data files (files are
dealt round-robin, so the work and the reads are spread over the job).
"""

from __future__ import annotations

import logging
import pickle
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron_async.integrity import checksums
from megatron_async.core import coordination
from megatron_async.errors import CheckpointIntegrityError
from megatron_async.integrity.inspection import find_completeness_problems
from megatron_async.storage.backend import storage_for

__all__ = ["find_damage", "verify_checkpoint_integrity"]

logger = logging.getLogger(__name__)


def find_damage(
    checkpoint_dir: str, *, require_checksums: bool = False, rank: int = 0, world_size: int = 1
) -> Tuple[List[str], Optional[int]]:
    """Re-hash ``rank``'s share of the data files and, on rank 0, check completeness.

    Runs on one rank (the ``verify`` command: rank 0 of 1, which checks everything).

    Returns:
        One message per problem (empty when intact), and how many checksum records the
        checkpoint holds (None when it has none).
    """
    problems: List[str] = []
    if rank == 0:
        problems += find_completeness_problems(checkpoint_dir)
    try:
        items = checksums.read_checksums(checkpoint_dir)
    except (OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError, EOFError) as exc:
        return problems + [f"the checksum records cannot be read: {exc}"], None
    if items is None:
        if require_checksums and rank == 0:
            problems.append(
                "no checksum records: the checkpoint was saved without checksums "
                "(TorchDistSaveConfig.checksums=False or another writer)"
            )
        return problems, None
    by_file: Dict[str, List[checksums.ItemChecksum]] = {}
    for item in items:
        by_file.setdefault(item.file, []).append(item)
    for name in sorted(by_file)[rank::world_size]:
        problems += checksums.verify_items(checkpoint_dir, by_file[name])
    return problems, len(items)


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
    try:
        if storage_for(checkpoint_dir).is_dir(checkpoint_dir):
            problems, _ = find_damage(
                checkpoint_dir, require_checksums=require_checksums, rank=rank, world_size=world_size
            )
        else:  # agreed below, so a rank that sees another file system does not leave its peers waiting
            problems = [f"{checkpoint_dir} is not a directory here; nothing to load"]
    except OSError as exc:
        problems = [f"reading {checkpoint_dir} failed on rank {rank}: {exc}"]

    def damaged(everyone: List[Tuple[int, List[str]]]) -> CheckpointIntegrityError:
        lines = [f"rank {r}: {p}" for r, rank_problems in everyone for p in rank_problems]
        return CheckpointIntegrityError(
            f"checkpoint {checkpoint_dir} is damaged ({len(lines)} problem(s)):\n  "
            + "\n  ".join(lines)
            + "\nLoad an older complete checkpoint (python -m megatron_async list SAVE_DIR)."
        )

    coordination.agree((rank, problems) if problems else None, damaged, group=group)
    logger.debug("rank %d: %s passed the integrity check", rank, checkpoint_dir)
