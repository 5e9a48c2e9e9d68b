"""The stager of a writer's save: every staging mode as one pipeline (trainer, every rank).

A storage writer enters staging once per save, through :func:`prepare_staged_write`
(as PyTorch DCP keeps its ``AsyncStager`` apart from its ``FileSystemWriter``): it names
its write path and that path's own arguments, and gets back the request's ``save_fn`` and
``preload_fn`` (:meth:`BucketStager.stage`). Every save goes the same way: reserve its
staging memory in the budget's ledger (:mod:`.budget`), give every tensor a host buffer,
copy, and hand the staged buckets to the writer through the save's gate (:mod:`.gate`).
Two choices differ, each made once per save:

* **where the buffers come from**: a state within the budget is one round, staged into
  its bucket layout's cached buffers (:mod:`.buffers`; a warm save is one ``torch.cat``
  per bucket); a larger one goes in rounds through the budget's pool (:mod:`.rounds`);
* **who copies**: the training thread, before scheduling returns (in rounds the first
  round, and the copy thread the others while scheduling waits); or, with overlapped
  staging, the copy thread alone after the hand-over, the next optimizer step waiting for
  it (:mod:`.overlapped`).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from functools import partial
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence, Tuple

import torch

from megatron_async.buckets.layout import ResolvedPlanData, WriteBucket, unpack_resolved_plan_data
from megatron_async.core.request import require_hand_over
from megatron_async.errors import StagingMemoryError
from megatron_async.staging.budget import StagingBufferCache, StagingLedger, resolve_budget
from megatron_async.staging.buffers import stage_buckets
from megatron_async.staging.overlapped import CopyThread, wait_for_staging
from megatron_async.core.config import STAGING_WAIT_S
from megatron_async.staging.gate import StagingGate
from megatron_async.staging.rounds import plan_bucket_rounds, stage_in_rounds

__all__ = ["BucketStager", "prepare_staged_write"]

_SECOND = operator.itemgetter(1)
_NBYTES = operator.attrgetter("nbytes")
_IS_CUDA = operator.attrgetter("is_cuda")


def _state_sizes(buckets: Sequence[WriteBucket]) -> Tuple[int, bool]:
    """The bytes of the buckets' tensors and whether any is on CUDA (``map``: every save
    of thousands of tensors runs this on the training thread)."""
    total, cuda = 0, False
    for bucket in buckets:
        tensors = list(map(_SECOND, bucket.data[1]))
        total += sum(map(_NBYTES, tensors))
        cuda = cuda or any(map(_IS_CUDA, tensors))
    return total, cuda


@dataclasses.dataclass
class BucketStager:
    """Stages one save's write buckets within the staging budget (trainer, every rank).

    Args:
        gate: the save's gate, one word per tensor item of ``buckets`` (also bound to the
            write path, which takes items in rounds and marks it done).
        buckets: the save's planned buckets.
        limit: the ``staging_memory_limit`` (None: one copy of the state).
        overlapped: copy on the copy thread after the hand-over (``overlap_staging``).
        cache: the trainer's reusable staging buffers (the default cache when None).
        cache_key: the bucket layout's key in ``cache`` (None: fresh buffers).
        stage_one_go: the writer's own staging of a state within the budget without
            overlap (a subclass's ``preload_tensors``); None stages into ``cache``.
        rounds_allowed: False when the write path cannot take items as they are copied
            (an override with the reference signature): a state above the budget, and
            overlapped staging, are refused.
        stats: receives ``rounds`` and ``peak_bytes`` of each save.
        timeout_s: bound on the wait for an earlier save's memory or copy, and on each
            wait for the writer in rounds.
    """

    gate: StagingGate
    buckets: Sequence[WriteBucket]
    _: dataclasses.KW_ONLY
    limit: Any = None
    overlapped: bool = False
    cache: Optional[StagingBufferCache] = None  # None: looked up when staging (so this pickles)
    cache_key: Optional[Hashable] = None
    stage_one_go: Optional[Callable[[], Any]] = None
    rounds_allowed: bool = True
    stats: dict = dataclasses.field(default_factory=dict)
    timeout_s: float = STAGING_WAIT_S

    def stage(self) -> Any:
        """Stage the buckets and return the staged data (trainer, the request's ``preload_fn``).

        Raises:
            StagingMemoryError: a single tensor exceeds the budget, earlier saves did not
                free the memory in time, or the write path cannot take items as they are
                copied; nothing was staged.
            StagingHandOverError: the staging continues after the hand-over (overlapped,
                or in rounds) but another library's caller runs this ``preload_fn``.
        """
        state_bytes, cuda = _state_sizes(self.buckets)
        budget = resolve_budget(self.limit, state_bytes)
        in_rounds = state_bytes > budget
        if (self.overlapped or in_rounds) and not self.rounds_allowed:
            what, instead = (
                ("overlapped staging (overlap_staging)", "save without overlap_staging")
                if self.overlapped else
                (f"this rank's state ({state_bytes} bytes), above the staging_memory_limit "
                 f"({budget} bytes),", "raise staging_memory_limit to at least the state")
            )
            raise StagingMemoryError(
                f"{what} needs a write path that takes items as they are copied; this writer's "
                "write path (an override without staging_control, or a subclass's "
                "write_preloaded_data) cannot take items in rounds. Accept staging_control in "
                f"the override and keep our write_preloaded_data, or {instead}"
            )
        cache = self.cache if self.cache is not None else StagingBufferCache.of_process()
        plan = None
        if in_rounds:  # refused before anything is held: a tensor above the budget, or no hand-over
            plan = plan_bucket_rounds(self.buckets, budget)
            require_hand_over(
                f"staging this rank's state ({state_bytes} bytes) in rounds through the "
                f"staging_memory_limit ({budget} bytes)",
                f"set staging_memory_limit to at least {state_bytes} bytes (one copy of the state)",
            )
            cache.clear()  # the idle buffers of saves in one round
        if self.overlapped:
            require_hand_over("overlapped staging (overlap_staging)", "save without overlap_staging")
            wait_for_staging(self.timeout_s)  # copies run one save at a time, in order
            CopyThread.of_process().hook_optimizer_steps()

        def stage_into(pool: Optional[torch.Tensor]) -> Any:
            if pool is not None:
                return stage_in_rounds(
                    self.buckets, pool, plan, self.gate, self.timeout_s, self.overlapped
                )
            if self.stage_one_go is not None and not self.overlapped:
                return self.stage_one_go()
            return stage_buckets(self.buckets, True, self.cache_key, cache,
                                 copy_later=self.gate if self.overlapped else None)

        staged = StagingLedger.of_process().stage_within(
            stage_into, state_bytes=state_bytes, budget=budget, in_rounds=in_rounds,
            gate=self.gate, pinned=cuda, timeout_s=self.timeout_s,
        )
        if in_rounds:
            self.stats.update(rounds=plan.rounds, peak_bytes=plan.pool_bytes)
        else:
            self.stats.update(rounds=1, peak_bytes=state_bytes)
        return staged


def _bind_supported(fn: Callable[..., Any], args: tuple, **options: Any) -> "partial[Any]":
    """``partial(fn, *args, **options)`` without the options ``fn`` does not take (trainer).

    A subclass may override a write path or ``preload_tensors`` with the reference API's
    signature only; it then runs without our extra options (checksums, bounded waits, the
    staging gate) instead of failing.
    """
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        options = {k: v for k, v in options.items() if k in params}
    return partial(fn, *args, **options)


def prepare_staged_write(
    write_path: Callable[..., None],
    write_args: tuple,
    write_options: Mapping[str, Any],
    *,
    preload_tensors: Callable[..., Any],
    resolved_plan_data: ResolvedPlanData,
    overlapped: bool,
    limit: Any,
    cache: Optional[StagingBufferCache],
    stats: dict,
    own_bucket_writer: bool = True,
) -> Tuple[Callable[..., None], Callable[[], Any]]:
    """Put one save's staging in front of its write path: ``(save_fn, preload_fn)`` (trainer).

    Runs in the trainer, on every rank, once per save with something to write: builds the
    save's gate and stager, and binds the gate to the write path (``staging_control``; a
    write path that does not take it is followed by the gate's *done* mark).

    Args:
        write_path: the writer's background write path (``write_preloaded_data_multithread``
            or ``_multiproc``, or a subclass's override). It takes the items in rounds if
            it accepts ``staging_control`` (an override with the reference signature does
            not, and a state above the budget is then refused).
        write_args: its leading positional arguments (``transform_list, use_msc, open_file``).
        write_options: its keyword options; those an override does not take are left out.
        preload_tensors: the writer's staging in one go (a subclass may override it),
            called with ``(resolved_plan_data, True)``.
        resolved_plan_data: the writer's ``resolved_plan_data``: the save's planned
            buckets and the key of their layout's cached buffers, what
            ``preload_tensors`` stages.
        overlapped, limit, cache, stats: as :class:`BucketStager`'s.
        own_bucket_writer: False when each bucket is written by a subclass's
            ``write_preloaded_data``, which may read a bucket's items without waiting for
            each to be copied: a state above the budget, and overlapped staging, are then
            refused (the writer would read buffers still being filled).

    Returns:
        ``save_fn``: the write path with its arguments and the save's gate bound; it
        takes the request's ``args``. ``preload_fn``: the stager's ``stage``.
    """
    identifier, buckets = unpack_resolved_plan_data(resolved_plan_data)
    gate = StagingGate(sum(len(bucket.data[1]) for bucket in buckets))
    save_fn = _bind_supported(write_path, write_args, **write_options, staging_control=gate)
    takes_gate = "staging_control" in save_fn.keywords
    if not takes_gate:
        save_fn = partial(_write_then_mark_done, gate, save_fn)
    stager = BucketStager(
        gate, buckets, limit=limit, overlapped=overlapped, cache=cache,
        cache_key=identifier.key if identifier is not None else None,
        stage_one_go=_bind_supported(
            preload_tensors, (resolved_plan_data, True), staging_cache=cache
        ),
        rounds_allowed=takes_gate and own_bucket_writer, stats=stats,
    )
    return save_fn, stager.stage


def _write_then_mark_done(gate: StagingGate, write: Callable[..., None], *args: Any,
                          **kwargs: Any) -> None:
    """Run a write path that does not take the save's gate, recording the writer and
    marking the gate done at the end as ours does (background writer): the save's staging
    memory stays counted until then."""
    gate.record_writer()
    try:
        write(*args, **kwargs)
    finally:
        gate.mark_done()
