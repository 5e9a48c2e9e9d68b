"""Turn a bad-input error found on some ranks into the same typed error on every rank.

Checks made while a save is planned (the target directory, the translated state dict,
the global plan) may fail on one rank only. If that rank simply raised, the others would
walk into the next collective and wait for it until the coordination timeout. Every
check therefore ends with one small gloo all-reduce: all ranks learn whether any rank
failed, and if so every rank raises one error that lists all the failures.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron_async.core import coordination
from megatron_async.errors import CheckpointInProgressError, CheckpointValidationError

__all__ = ["agree_or_raise"]

_Description = Tuple[int, bool, str]


def _describe(error: Optional[BaseException]) -> Optional[_Description]:
    if error is None:
        return None
    return coordination.get_rank(), isinstance(error, CheckpointInProgressError), str(error)


def agree_or_raise(
    local_error: Optional[BaseException],
    what: str,
    flags: Sequence[int] = (),
    group: Optional[dist.ProcessGroup] = None,
) -> List[int]:
    """Raise on every rank if ``local_error`` is set on any rank; else reduce ``flags``.

    Runs on every rank: one all-reduce (MAX of ``[failed, *flags]``), plus an all-gather
    of the error messages only when a rank failed.

    Args:
        local_error: this rank's problem, or None.
        what: the step that was checked, for the message ("target check", "planning").
        flags: small integers to reduce with MAX in the same collective.
        group: the coordination group; defaults to the library's gloo group.

    Returns:
        The element-wise maxima of ``flags`` over all ranks.

    Raises:
        CheckpointInProgressError: every failing rank reported a save still in flight.
        CheckpointValidationError: any other problem on any rank.
    """
    reduced = coordination.all_reduce_max([int(local_error is not None), *flags], group)
    if not reduced[0]:
        return reduced[1:]
    described = [d for d in coordination.all_gather_objects(_describe(local_error), group) if d]
    lines = [f"{what} failed on {len(described)} rank(s):"]
    lines += [f"  rank {rank}: {message}" for rank, _, message in sorted(described)]
    error_type = (
        CheckpointInProgressError
        if all(in_progress for _, in_progress, _ in described)
        else CheckpointValidationError
    )
    raise error_type("\n".join(lines)) from local_error
