"""The warm save's finalization on the coordinator at N simulated ranks (``--scale`` row ``ours_warm``).

A warm save (cached plans, unchanged structure) gathers no write results: every rank
checks its own items against its previous save, one all-reduce agrees, and the
coordinator writes ``.metadata`` from the previous commit's bytes. This module runs the
*real* finalization (:func:`~megatron_async.saver.finalize.save_state_dict_async_finalize`)
as the coordinator runs it, on the synthesized results of :mod:`tools.bench.scale_plans`:

1. the first save's full commit from every rank's results (not timed; it fills the
   coordinator's record of its previous save as a real first save does);
2. a second save of the same structure (new digests, new directory), timed: the
   coordinator's reuse check over its own items, its stale-checkpoint comparison, the
   splice of ``.metadata`` and its durable write. The all-reduce itself (7 integers on
   gloo) is not simulated: it costs one network round trip, whatever N is.

What the full path would gather is reported too (:mod:`tools.bench.gather_model`); the
warm path gathers 0 bytes.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from typing import Any, Dict, List

__all__ = ["measure_warm_finalize"]


class _CoordinatorWriter:
    """The coordinator's writer as the finalization sees it once the background write is done."""

    def __init__(self, directory: str, results: List[Any]):
        self.checkpoint_id = self.checkpoint_dir = directory
        self._results = results
        self.save_id = uuid.uuid4().hex

    def retrieve_write_results(self) -> List[Any]:
        return self._results

    def storage_meta(self):
        from torch.distributed.checkpoint.metadata import StorageMeta

        return StorageMeta(checkpoint_id=self.checkpoint_dir, save_id=self.save_id)

    def finish(self, metadata, results):
        from megatron_async.writer.commit import commit_checkpoint

        return commit_checkpoint(self.checkpoint_dir, metadata, results, self.storage_meta())


def measure_warm_finalize(metadata: Any, results: List[List[Any]], directory: str) -> Dict[str, float]:
    """Time the coordinator's warm finalization; returns seconds, bytes and what it gathered.

    Args:
        metadata: the global metadata of the plans (``build_global_metadata``).
        results: every rank's write results; rank 0 is the coordinator.
        directory: a scratch directory for the two checkpoints.
    """
    from torch.distributed.checkpoint.utils import _DistWrapper

    from megatron_async.core import coordination
    from megatron_async.integrity.staleness import digests_of
    from megatron_async.saver import finalize
    from megatron_async.storage.backend import storage_for
    from megatron_async.writer.commit import storage_layout

    first, second = os.path.join(directory, "iter_1"), os.path.join(directory, "iter_2")
    os.makedirs(first)
    os.makedirs(second)
    cache = finalize.PreviousSave()
    first_writer = _CoordinatorWriter(first, results[0])
    template = first_writer.finish(metadata, results)
    cache.last = finalize.CommittedSave(
        first, dict(digests_of(results[0])), storage_layout(results[0]), metadata, template
    )

    mine = [dataclasses.replace(r, checksum=f"{i + (1 << 60):016x}") for i, r in enumerate(results[0])]
    writer = _CoordinatorWriter(second, mine)
    wrapper = _DistWrapper(None, False, 0)
    gathers = coordination.gather_count("results")
    start = time.perf_counter()
    finalize.save_state_dict_async_finalize(
        writer, metadata, wrapper, previous_save=cache
    )
    warm_s = time.perf_counter() - start
    if coordination.gather_count("results") != gathers:
        raise AssertionError("the warm finalization gathered write results")
    if template is None:
        raise AssertionError("no .metadata template was made; the warm save committed in full")
    # The parts of that finalization again, alone: the per-item checks on the coordinator's
    # own items, the splice (no per-item work), and the durable write of the bytes.
    start = time.perf_counter()
    cache.matches(storage_layout(mine), metadata, True)
    cache.compare(dict(digests_of(mine)))
    data = template.render_pieces(writer.storage_meta())
    cpu_s = time.perf_counter() - start
    start = time.perf_counter()
    storage_for(second).write_atomically(os.path.join(second, "metadata.copy"), data)
    write_s = time.perf_counter() - start
    return {
        "warm_s": warm_s,
        "cpu_s": cpu_s,
        "write_s": write_s,
        "metadata_bytes": os.path.getsize(os.path.join(second, ".metadata")),
    }

