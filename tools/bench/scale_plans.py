"""The scale benchmark's input: the local plans and write results of N simulated ranks.

:func:`synthesize` builds, for a layout (``tp8``, ``dist_optimizer``, ``moe``; see
:mod:`tools.bench.scale`), what each of N ranks would send its coordinator: its local save
plan (the shapes megatron-core's layouts produce) and, after the write, its write results
with a checksum, one file per rank. Deterministic and cheap, so that thousands of ranks fit
in one process.

Runs in the process that measures: a child of :func:`tools.bench.scale.measure`, or a rank
of :mod:`tools.bench.gather_calibration` (which ships one rank's share for real).
"""

from __future__ import annotations

import pickle
from typing import List, Sequence

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

__all__ = ["LAYOUTS", "shard_write_item", "synthesize_rank", "synthesize"]

LAYOUTS = ("tp8", "dist_optimizer", "moe")

_ROWS_PER_CHUNK = 64
_COLUMNS = 128
_ITEM_BYTES = _ROWS_PER_CHUNK * _COLUMNS * 2  # bf16


def shard_write_item(fqn: str, offsets: Sequence[int], sizes: Sequence[int],
                     whole: Sequence[int]) -> WriteItem:
    """One shard's write item, as DCP's planner makes it (a new ``torch.Size`` per value)."""
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=torch.bfloat16),
            size=torch.Size(whole),
        ),
    )


def _rank_items(layout: str, rank: int, ranks: int, items_per_rank: int) -> List[WriteItem]:
    """The write items of one rank under ``layout`` (deterministic)."""
    items = []
    if layout == "tp8":
        group, tp_rank = divmod(rank, 8)
        tp_size = min(8, ranks - group * 8)
        for j in range(items_per_rank):
            whole = (_ROWS_PER_CHUNK * tp_size, _COLUMNS)
            items.append(shard_write_item(f"stage{group}.layer{j}.weight",
                                          (tp_rank * _ROWS_PER_CHUNK, 0),
                                          (_ROWS_PER_CHUNK, _COLUMNS), whole))
    elif layout == "dist_optimizer":
        numel = _ROWS_PER_CHUNK * _COLUMNS
        for j in range(items_per_rank):
            items.append(shard_write_item(f"optimizer.state.{j}.exp_avg", (rank * numel,),
                                          (numel,), (ranks * numel,)))
    elif layout == "moe":
        for j in range(items_per_rank):
            shape = (_ROWS_PER_CHUNK, _COLUMNS)
            items.append(shard_write_item(f"experts.{rank}.linear{j}.weight", (0, 0), shape, shape))
    else:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    return items


def synthesize_rank(layout: str, rank: int, ranks: int, items_per_rank: int,
                    shared_sizes: bool = True):
    """The local plan and the write results of one rank, as it ships them to the coordinator.

    ``shared_sizes``: one ``torch.Size`` object per distinct value, as our ranks make their
    plans (:func:`megatron_async.saver.global_metadata.share_equal_sizes`); False for DCP's and megatron-core's
    own ranks, whose planners make a new one per value.
    """
    from megatron_async.saver.global_metadata import share_equal_sizes
    from megatron_async.writer.bucket_io import ChecksummedWriteResult

    plan = SavePlan(_rank_items(layout, rank, ranks, items_per_rank))
    items = (share_equal_sizes(plan) if shared_sizes else plan).items  # results share indexes
    file_name = f"__{rank}_0.distcp"
    results = [
        ChecksummedWriteResult(
            item.index, _ITEM_BYTES,
            _StorageInfo(file_name, position * _ITEM_BYTES, _ITEM_BYTES),
            f"{(rank * 1_000_003 + position) & 0xFFFFFFFFFFFFFFFF:016x}",
        )
        for position, item in enumerate(items)
    ]
    return SavePlan(items), results


def synthesize(layout: str, ranks: int, items_per_rank: int, shared_sizes: bool = True):
    """Local plans and write results of every rank, as the coordinator receives them.

    Each rank's plan and results go through pickle as a gather sends them: objects a rank
    shares stay shared within its own, and no object is shared between ranks.
    """
    plans, results = [], []
    for rank in range(ranks):
        plan, rank_results = synthesize_rank(layout, rank, ranks, items_per_rank, shared_sizes)
        plans.append(pickle.loads(pickle.dumps(plan)))
        results.append(pickle.loads(pickle.dumps(rank_results)))
    return plans, results
