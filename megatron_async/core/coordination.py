"""Checkpoint coordination collectives over a dedicated gloo process group.

Every rank runs the code in this module. All checkpoint coordination (is the save
done everywhere? did any rank fail? which rank failed how?) goes through one gloo
group created for that purpose, for two reasons:

* gloo runs on CPU tensors, so coordination works in CPU-only jobs and never needs
  a CUDA device or stream, even in NCCL jobs;
* a group of its own keeps checkpoint traffic from interleaving with training
  collectives on the default group, which could otherwise deadlock when one rank
  is inside a training collective while another waits in a checkpoint collective.

Every collective here is bounded by the group's timeout and turns a dead or
diverged peer into a :class:`~megatron_async.errors.CoordinationError`.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_async.errors import AsyncSaveFailedError, CoordinationError, RankFailure

__all__ = [
    "DEFAULT_COORDINATION_TIMEOUT_S",
    "is_distributed",
    "get_rank",
    "get_world_size",
    "get_coordination_group",
    "all_reduce_max",
    "all_gather_objects",
    "barrier",
    "raise_if_any_rank_failed",
]

logger = logging.getLogger(__name__)

DEFAULT_COORDINATION_TIMEOUT_S = 600.0
"""How long one coordination collective may wait for the slowest peer to join it."""

_group_lock = threading.Lock()
_cached_group: Optional[dist.ProcessGroup] = None
_cached_for_world: Optional[object] = None
_cached_timeout_s: float = DEFAULT_COORDINATION_TIMEOUT_S


def is_distributed() -> bool:
    """Return True when torch.distributed is available and initialized."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank, or 0 outside a distributed job."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """World size, or 1 outside a distributed job."""
    return dist.get_world_size() if is_distributed() else 1


def get_coordination_group(
    timeout_s: float = DEFAULT_COORDINATION_TIMEOUT_S,
) -> Optional[dist.ProcessGroup]:
    """Return the gloo group used for checkpoint coordination, creating it on first use.

    Runs on every rank. Creating a group is itself a collective on the default group:
    the first call must happen on all ranks in the same order relative to other group
    creations (constructing an :class:`AsyncCallsQueue` or a save strategy on every rank
    does that). Later calls return the cached group. When the default group is already
    gloo it is still separated, so training collectives on it never interleave with
    checkpoint coordination.

    Args:
        timeout_s: bound on each collective of the group (applied when it is created).

    Returns:
        The group, or None outside a distributed job (single process).
    """
    global _cached_group, _cached_for_world, _cached_timeout_s
    if not is_distributed():
        return None
    world = dist.group.WORLD
    with _group_lock:
        if _cached_group is not None and _cached_for_world is world:
            if timeout_s != _cached_timeout_s:
                logger.debug(
                    "the coordination group already exists with timeout %.0fs; %.0fs is ignored",
                    _cached_timeout_s, timeout_s,
                )
            return _cached_group
        logger.debug("rank %d: creating the gloo checkpoint-coordination group", dist.get_rank())
        _cached_group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=float(timeout_s))
        )
        _cached_for_world = world
        _cached_timeout_s = float(timeout_s)
        return _cached_group


def _describe_collective_failure(what: str, exc: BaseException) -> CoordinationError:
    return CoordinationError(
        f"rank {get_rank()}: checkpoint coordination collective '{what}' failed ({exc}). "
        "A peer rank probably died, stopped calling maybe_finalize_async_calls, or scheduled "
        "a different number of saves; check the other ranks' logs."
    )


def all_reduce_max(values: Sequence[int], group: Optional[dist.ProcessGroup] = None) -> List[int]:
    """Element-wise MAX of small integer vectors across ranks (one gloo all-reduce).

    Args:
        values: this rank's integers.
        group: the coordination group; defaults to :func:`get_coordination_group`.

    Returns:
        The element-wise maxima, identical on every rank; ``values`` itself when not
        distributed.

    Raises:
        CoordinationError: the collective failed or timed out.
    """
    if not is_distributed():
        return list(values)
    group = group if group is not None else get_coordination_group()
    tensor = torch.tensor(list(values), dtype=torch.int64)
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    except Exception as exc:  # gloo raises RuntimeError subclasses on peer loss/timeout
        raise _describe_collective_failure("all_reduce", exc) from exc
    return [int(v) for v in tensor.tolist()]


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Gather one picklable object from every rank onto every rank (gloo).

    Raises:
        CoordinationError: the collective failed or timed out.
    """
    if not is_distributed():
        return [obj]
    group = group if group is not None else get_coordination_group()
    gathered: List[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, obj, group=group)
    except Exception as exc:
        raise _describe_collective_failure("all_gather_object", exc) from exc
    return gathered


def barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    """Wait for every rank, bounded by the coordination group's timeout."""
    all_reduce_max([0], group)


def raise_if_any_rank_failed(
    local_failure: Optional[RankFailure],
    group: Optional[dist.ProcessGroup] = None,
    checkpoint: Optional[str] = None,
) -> None:
    """Turn a failure on any rank into the same :class:`AsyncSaveFailedError` on all ranks.

    Runs on every rank and costs one small all-reduce when nothing failed; only when a
    rank failed does it also gather the failures (so every rank can report all of them).

    Args:
        local_failure: this rank's failure, or None if it succeeded.
        group: the coordination group; defaults to :func:`get_coordination_group`.
        checkpoint: the checkpoint being written, for the error message.

    Raises:
        AsyncSaveFailedError: on every rank, when at least one rank passed a failure.
    """
    if not is_distributed():
        if local_failure is not None:
            raise AsyncSaveFailedError({local_failure.rank: local_failure}, checkpoint)
        return
    (any_failed,) = all_reduce_max([int(local_failure is not None)], group)
    if not any_failed:
        return
    gathered = all_gather_objects(local_failure, group)
    failures = {f.rank: f for f in gathered if f is not None}
    raise AsyncSaveFailedError(failures, checkpoint)
