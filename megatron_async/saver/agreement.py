"""Turn a bad-input error found on some ranks into the same typed error on every rank.

Checks made while a save is planned (the target directory, the translated state dict,
the global plan) may fail on one rank only. If that rank simply raised, the others would
walk into the next collective and wait for it until the coordination timeout. Every
check therefore ends with one small gloo all-reduce: all ranks learn whether any rank
failed, and if so every rank raises one error that lists all the failures.

:func:`agreed_step` is the pattern of DCP's ``_DistWrapper.reduce_scatter`` for a local
step: run it, agree on failures, raise the same error everywhere, so that a save reads
as a sequence of named steps. :func:`agree_or_raise` is the agreement alone, for a step
whose failure is known without running a function.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

import torch.distributed as dist

from megatron_async.core import coordination
from megatron_async.errors import (
    AsyncCheckpointError, CheckpointInProgressError, CheckpointValidationError,
)

__all__ = ["agree_or_raise", "agreed_step"]

_Description = Tuple[int, bool, str]
T = TypeVar("T")


def _describe(error: Optional[BaseException]) -> Optional[_Description]:
    """This rank's failure for the agreed message: ours as they read (they say what to do),
    anyone else's with its type, which is often the only information (megatron-core's
    ``TypeError(<class 'torch.Tensor'>)`` for a plain tensor in a sharded state dict)."""
    if error is None:
        return None
    rank = coordination.get_rank()
    message = str(error)
    if not isinstance(error, AsyncCheckpointError):
        message = f"{type(error).__name__}: {message}" if message else type(error).__name__
    message = message.removeprefix(f"rank {rank}: ")  # the agreed message names the rank
    return rank, isinstance(error, CheckpointInProgressError), message


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


def agreed_step(
    what: str,
    local_step: Callable[[], T],
    group: Optional[dist.ProcessGroup] = None,
    flags: Optional[Callable[[Optional[T]], Sequence[int]]] = None,
) -> Tuple[T, List[int]]:
    """Run ``local_step`` on this rank, then agree with every rank on whether any failed
    (:func:`agree_or_raise`, with the step's ``Exception`` as this rank's error; a
    ``BaseException`` such as an interrupt propagates at once).

    Runs on every rank, which must all call it at the same point; the step itself runs
    no collective.

    Args:
        what: the step, for the message ("local save planning").
        local_step: this rank's part; its result is returned.
        group: the coordination group; defaults to the library's gloo group.
        flags: maps the step's result (None when it raised) to small integers reduced
            with MAX in the same collective; it must give the same number on every rank
            and must not raise.

    Returns:
        ``(result of local_step, element-wise maxima of the flags over all ranks)``.
    """
    result: Optional[T] = None
    error: Optional[BaseException] = None
    try:
        result = local_step()
    except Exception as exc:  # agreed on below, so that no rank is left waiting
        error = exc
    reduced = agree_or_raise(error, what, flags(result) if flags is not None else (), group)
    return result, reduced
