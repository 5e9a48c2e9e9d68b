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
import os
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from megatron_async.core.config import DEFAULT_CONFIG
from megatron_async.core.gc_pause import paused_gc
from megatron_async.errors import (
    AsyncSaveFailedError, CoordinationError, RankFailure, agreed_error, describe_for_agreement,
)

__all__ = [
    "is_distributed",
    "get_rank",
    "get_world_size",
    "local_world_size",
    "get_coordination_group",
    "new_transfer_group",
    "coordination_timeout_s",
    "all_reduce_max",
    "all_gather_objects",
    "gather_count",
    "count_gather",
    "gather_on_coordinator",
    "agree",
    "save_failed",
    "run_on_coordinator",
    "agreed_step",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F")

COORDINATION_GROUP_NAME = "megatron_async_checkpoint_coordination"
"""The name of the coordination group in torch's registry of process groups."""

# A per-process fact with no owner: the one coordination group of this process's default
# group, shared by every queue, strategy and save of the job (torch's own group registry
# is process-wide too), and recreated when the job recreates its default group.
_group_lock = threading.Lock()
_cached_group: Optional[dist.ProcessGroup] = None
_cached_for_world: Optional[object] = None
_cached_timeout_s: float = DEFAULT_CONFIG.coordination_timeout_s
_recreated_in_world = 0
_gathers = {"plan": 0, "results": 0}


def is_distributed() -> bool:
    """Return True when torch.distributed is available and initialized."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank, or 0 outside a distributed job."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """World size, or 1 outside a distributed job."""
    return dist.get_world_size() if is_distributed() else 1


def local_world_size() -> int:
    """The ranks on this node: torchrun's ``LOCAL_WORLD_SIZE`` (every rank, local).

    1 without it, and where it is empty, not an integer or below 1: callers only divide
    a node's CPUs or memory by it, which must not fail a save.
    """
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        return 1


def get_coordination_group(timeout_s: Optional[float] = None) -> Optional[dist.ProcessGroup]:
    """Return the gloo group used for checkpoint coordination, creating it on first use.

    Runs on every rank. Unlike ``torch.distributed.new_group``, creating this group is
    not a step in the job's sequence of group creations, so each rank may create it
    whenever it first needs it (its first queue, strategy or save), before or after
    megatron-core (re)creates its model-parallel groups:

    * it has a fixed name instead of the next number of torch's group counter, so it
      never shifts the names of the groups created after it (torch pairs a group's
      ranks by that name: a rank that created one group more than its peers would
      connect its later groups to the wrong peers and hang);
    * its gloo connections are made by the first collective on it, not at creation,
      so creating it waits for no peer (torch >= 2.7; older versions connect at
      creation, which then waits, bounded by ``timeout_s``, until every rank creates it).

    The group belongs to the current default group: when the job destroys and
    re-initializes the default group, the next call creates a new one.

    Args:
        timeout_s: bound on each collective of the group, applied when it is created
            (None: the default of ``AsyncCallerConfig.coordination_timeout_s``). The first
            creation in a default group decides it; a later, different value is ignored
            with a warning.

    Returns:
        The group, or None outside a distributed job (single process).
    """
    global _cached_group, _cached_for_world, _cached_timeout_s, _recreated_in_world
    if not is_distributed():
        return None
    world = dist.group.WORLD
    with _group_lock:
        if _cached_group is not None and _cached_for_world is world:
            if _cached_group in dist.distributed_c10d._world.pg_map:  # not destroyed
                if timeout_s is not None and float(timeout_s) != _cached_timeout_s:
                    logger.warning(
                        "the checkpoint-coordination group already exists with timeout %.0fs; %.0fs "
                        "is ignored (the first queue or strategy of the job decides it)",
                        _cached_timeout_s, timeout_s,
                    )
                return _cached_group
            _recreated_in_world += 1  # someone destroyed it: a new name in the same world
        else:
            _recreated_in_world = 0
        name = COORDINATION_GROUP_NAME + (f"_{_recreated_in_world}" if _recreated_in_world else "")
        logger.debug("rank %d: creating the gloo checkpoint-coordination group %s", dist.get_rank(), name)
        bound_s = DEFAULT_CONFIG.coordination_timeout_s if timeout_s is None else float(timeout_s)
        _cached_group = _create_named_gloo_group(name, bound_s)
        _cached_for_world = world
        _cached_timeout_s = bound_s
        return _cached_group


def coordination_timeout_s() -> float:
    """The bound on each collective of the coordination group (the default before one exists)."""
    return _cached_timeout_s


def _create_named_gloo_group(
    name: str, timeout_s: float, ranks: Optional[Sequence[int]] = None, lazy: bool = True
) -> dist.ProcessGroup:
    """A gloo group of ``ranks`` (default: every rank) under ``name`` (every rank in it):
    connected at its first collective (``lazy``), else at creation, which then waits,
    bounded by ``timeout_s``, until every rank in it created it too."""
    c10d = dist.distributed_c10d
    timeout = datetime.timedelta(seconds=timeout_s)
    members = list(range(dist.get_world_size())) if ranks is None else sorted(ranks)
    previous = os.environ.get(_GLOO_LAZY_INIT)
    os.environ[_GLOO_LAZY_INIT] = "1" if lazy else "0"
    try:
        group, _ = c10d._new_process_group_helper(
            len(members), members.index(dist.get_rank()), members, "gloo",
            c10d._get_default_store(), name, timeout=timeout,
        )
    finally:
        if previous is None:
            os.environ.pop(_GLOO_LAZY_INIT, None)
        else:
            os.environ[_GLOO_LAZY_INIT] = previous
    c10d._world.pg_group_ranks[group] = {r: i for i, r in enumerate(members)}
    return group


def new_transfer_group(name: str, ranks: Sequence[int], timeout_s: float) -> dist.ProcessGroup:
    """A gloo group for one bulk transfer between ``ranks``, to be destroyed after it
    (every rank in ``ranks``, none else, at the same point).

    Point-to-point operations that a timeout leaves posted stay on this group and never
    meet a later collective or transfer: the caller destroys it
    (``torch.distributed.destroy_process_group``) once the transfer ended, finished or
    not. Every pair connects at creation, which waits (bounded by ``timeout_s``) until
    every rank in ``ranks`` created it; a lazily connected group would block a receive
    from a peer that never sends without bound. ``name`` must be new in this job (torch
    keys the group's rendezvous by it) and the same on every rank in ``ranks``.

    Raises:
        CoordinationError: a rank in ``ranks`` did not create it within ``timeout_s``.
    """
    try:
        return _create_named_gloo_group(name, timeout_s, ranks, lazy=False)
    except Exception as exc:
        raise _describe_collective_failure(f"creating the group {name}", exc) from exc


_GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
"""torch's switch for gloo groups that connect at their first collective."""


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
    return _all_reduce(values, dist.ReduceOp.MAX if is_distributed() else None, group)


def _all_reduce(values: Sequence[int], op: Any, group: Optional[dist.ProcessGroup]) -> List[int]:
    if not is_distributed():
        return list(values)
    group = group if group is not None else get_coordination_group()
    tensor = torch.tensor(list(values), dtype=torch.int64)
    try:
        dist.all_reduce(tensor, op=op, group=group)
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


def gather_count(kind: str) -> int:
    """How many gathers of ``kind`` (``"plan"``, ``"results"``) this process took part in
    (a warm save adds 0): a test hook."""
    return _gathers[kind]


def count_gather(kind: str) -> None:
    """Count one gather of ``kind`` this process takes part in."""
    with _group_lock:
        _gathers[kind] += 1


def gather_on_coordinator(obj: Any, dist_wrapper: Any, kind: str) -> Optional[List[Any]]:
    """Gather ``obj`` on DCP's ``dist_wrapper``'s coordinator (every rank; counted as
    ``kind``). The coordinator unpickles every rank's object: with the cyclic collector
    running that took 4-5 x longer (tools/bench/gather_calibration.py), so it is paused."""
    count_gather(kind)
    with paused_gc():
        return dist_wrapper.gather_object(obj)


def agree(
    local_failure: Optional[F],
    error: Callable[[List[F]], BaseException],
    counts: Sequence[int] = (),
    group: Optional[dist.ProcessGroup] = None,
) -> List[int]:
    """Raise the same error on every rank when any rank failed; else sum ``counts``.

    The one agreement of the library (every rank, each at the same point): one small
    all-reduce (SUM of ``[failed, *counts]``: a flag summed is nonzero when any rank set
    it); only when a rank failed are the failures gathered, so that every rank raises one
    error listing all of them.

    Args:
        local_failure: this rank's failure (a picklable record), or None.
        error: the error every rank raises, from the failing ranks' records in rank
            order (:func:`save_failed`; :func:`agreed_step`'s validation error).
        counts: small integers to sum over all ranks in the same collective.
        group: the coordination group; defaults to :func:`get_coordination_group`.

    Returns:
        The sums of ``counts`` over all ranks.
    """
    flagged = [int(local_failure is not None), *counts]
    summed = _all_reduce(flagged, dist.ReduceOp.SUM if is_distributed() else None, group)
    if summed[0]:
        raise error([f for f in all_gather_objects(local_failure, group) if f is not None])
    return summed[1:]


def save_failed(checkpoint: Optional[str] = None) -> Callable[[List[RankFailure]], BaseException]:
    """:func:`agree`'s error for a failed save: :class:`AsyncSaveFailedError` over the
    failing ranks' :class:`RankFailure` records, naming ``checkpoint``."""
    return lambda failures: AsyncSaveFailedError({f.rank: f for f in failures}, checkpoint)


def run_on_coordinator(
    phase: str,
    step: Callable[[], T],
    checkpoint: Optional[str] = None,
    group: Optional[dist.ProcessGroup] = None,
    is_coordinator: Optional[bool] = None,
) -> Optional[T]:
    """Run ``step`` on the coordinator, then agree on its outcome (every rank): the other
    ranks wait in one small all-reduce, and a failure of the step becomes the same
    :class:`AsyncSaveFailedError` on every rank (phase ``phase``), never an error on
    rank 0 alone. ``step`` bounds itself if it touches the file system.

    Returns:
        What ``step`` returned on the coordinator (``is_coordinator``; default: rank 0);
        None on the other ranks.
    """
    rank = get_rank()
    failure: Optional[RankFailure] = None
    result: Optional[T] = None
    if rank == 0 if is_coordinator is None else is_coordinator:
        try:
            result = step()
        except Exception as exc:  # raised on every rank below
            logger.error("rank %d: %s of %s failed: %s", rank, phase, checkpoint, exc)
            failure = RankFailure.from_exception(rank, phase, exc)
    agree(failure, save_failed(checkpoint), group=group)
    return result


def agreed_step(
    what: str,
    local_step: Callable[[], T],
    group: Optional[dist.ProcessGroup] = None,
    flags: Optional[Callable[[Optional[T]], Sequence[int]]] = None,
) -> Tuple[T, List[int]]:
    """Run ``local_step`` on this rank, then agree with every rank on whether any failed.

    DCP's ``_DistWrapper.reduce_scatter`` for a local step (every rank, at the same point;
    the step runs no collective): a check that fails on some ranks only (the target, the
    state dict, the plan) raises the same error on every rank instead of leaving the
    others waiting in the next collective. A ``BaseException`` propagates at once.

    Args:
        what: the step, for the message ("local save planning").
        local_step: this rank's part; its result is returned.
        group: the coordination group; defaults to :func:`get_coordination_group`.
        flags: maps the step's result (None when it raised) to small integers summed in
            the same collective; the same number on every rank, and it must not raise.

    Returns:
        ``(result of local_step, sums of the flags over all ranks)``.

    Raises:
        CheckpointInProgressError: every failing rank reported a save still in flight.
        CheckpointValidationError: any other failure on any rank.
    """
    result: Optional[T] = None
    error: Optional[Exception] = None
    try:
        result = local_step()
    except Exception as exc:  # agreed on below, so that no rank is left waiting
        error = exc
    counts = flags(result) if flags is not None else ()
    described = describe_for_agreement(error, get_rank()) if error is not None else None
    summed = agree(described, lambda every: agreed_error(what, every, error), counts, group)
    return result, summed
