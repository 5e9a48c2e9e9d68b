"""The coordinator's global metadata of a decentralized save: empty shards, real overlaps.

Every rank writes its own local plan as it is, so the coordinator refuses items planned
by two ranks, except tensor chunks without elements, which uneven splits (distributed
optimizer buckets, MoE experts) put on several ranks at one offset.
"""

from __future__ import annotations

from typing import List, Sequence

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from megatron_async.errors import CheckpointValidationError
from megatron_async.mcore import generation
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.saver.global_metadata import build_global_metadata

pytestmark = pytest.mark.timeout(60)


def shard_item(
    fqn: str, offsets: Sequence[int], sizes: Sequence[int], global_shape: Sequence[int]
) -> WriteItem:
    """The write item megatron-core's translation makes of one shard of ``fqn`` (float32)."""
    return WriteItem(
        index=MetadataIndex(fqn, list(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(global_shape),
        ),
    )


def split_plans(fqn: str, sizes: Sequence[int], trailing: Sequence[int] = ()) -> List[SavePlan]:
    """One local plan per rank: ``fqn`` split along axis 0 into ``sizes`` (zeros allowed)."""
    total, plans, offset = sum(sizes), [], 0
    for size in sizes:
        offsets = [offset] + [0] * len(trailing)
        plans.append(SavePlan([shard_item(fqn, offsets, [size, *trailing], [total, *trailing])]))
        offset += size
    return plans


def save_planner():
    """megatron-core's save planner, as the strategy creates it (decentralized planning)."""
    return generation.create_save_planner(TorchDistSaveConfig())


def _chunks(metadata, fqn):
    return [(tuple(c.offsets), tuple(c.sizes)) for c in metadata.state_dict_metadata[fqn].chunks]


def test_empty_shards_at_one_offset_are_listed_once():
    plans = split_plans("a", [15, 15, 0, 0])
    metadata = build_global_metadata(save_planner(), plans)
    assert _chunks(metadata, "a") == [((0,), (15,)), ((15,), (15,)), ((30,), (0,))]
    assert not hasattr(metadata, "all_local_plans")  # a digest per rank instead (test_plan_digests)


def test_empty_two_dimensional_shards_are_listed_once():
    metadata = build_global_metadata(save_planner(), split_plans("m", [20, 10, 0, 0], [4]))
    assert _chunks(metadata, "m") == [((0, 0), (20, 4)), ((20, 0), (10, 4)), ((30, 0), (0, 4))]


@pytest.mark.parametrize("sizes", [[0, 30], [0, 10, 10, 10], [10, 0, 20]])
def test_an_empty_shard_at_the_offset_of_data_leaves_the_data_listed(sizes):
    metadata = build_global_metadata(save_planner(), split_plans("b", sizes))
    chunks = _chunks(metadata, "b")
    assert [c for c in chunks if c[1] == (0,)] == []
    assert sum(size for _, (size,) in chunks) == 30


def test_a_real_overlap_still_raises():
    # Ranks 1 and 2 hold the same twenty elements: a real overlap, not an empty shard.
    plans = split_plans("a", [10, 20])
    plans.append(plans[1])
    expected = r"overlapping shards\): a at offset \(10,\) on ranks \[1, 2\]"
    with pytest.raises(CheckpointValidationError, match=expected):
        build_global_metadata(save_planner(), plans)


def test_a_partial_overlap_still_raises():
    # Elements 10..20 are held by both ranks, whose shards start at different offsets.
    plans = [
        SavePlan([shard_item("a", [0], [20], [30])]),
        SavePlan([shard_item("a", [10], [20], [30])]),
    ]
    with pytest.raises(CheckpointValidationError, match="overlapping"):
        build_global_metadata(save_planner(), plans)


def test_empty_shards_do_not_hide_a_missing_one():
    plans = split_plans("a", [10, 0, 0])
    plans[0] = SavePlan([shard_item("a", [0], [10], [30])])  # elements 10..30 held by no rank
    with pytest.raises(CheckpointValidationError, match="fill"):
        build_global_metadata(save_planner(), plans)
