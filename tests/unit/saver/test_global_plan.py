"""The coordinator's one-pass metadata build against DCP's global planning, on the same plans.

``build_metadata`` must make exactly the metadata that DCP's ``DefaultSavePlanner`` (as
megatron-core's planner uses it) makes of the plans without their redundant empty
chunks, and refuse the layouts DCP's validation refuses.
"""

from __future__ import annotations

import io
from typing import List, Sequence

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from megatron_async.errors import CheckpointValidationError
from megatron_async.mcore import generation
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.saver import state_dict_saver
from megatron_async.saver.global_metadata import (
    build_global_metadata,
    plans_globally_like_dcp,
    without_redundant_empty_chunks,
)
from megatron_async.saver.global_metadata import build_metadata
from megatron_async.writer.filesystem import FileSystemWriterAsync

pytestmark = pytest.mark.timeout(60)


def shard(fqn: str, offsets: Sequence[int], sizes: Sequence[int], whole: Sequence[int],
          dtype=torch.float32, kind=WriteItemType.SHARD) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, list(offsets)),
        type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(whole),
        ),
    )


def blob(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(8))


def dcp_metadata(plans: List[SavePlan]):
    """DCP's metadata of the same plans (megatron-core's planner: DCP's global planning)."""
    planner = DefaultSavePlanner(flatten_state_dict=False)
    _, metadata = planner.create_global_plan(without_redundant_empty_chunks(plans))
    return metadata


def _uneven_plans() -> List[SavePlan]:
    """Four ranks: a tensor split unevenly along axis 0 with empty chunks (some at an
    offset with data), a 2-D tensor split along axis 1, bf16 experts, objects per rank."""
    rows = [7, 0, 5, 0]  # rank 1's empty chunk sits at rank 2's offset; rank 3's at the end
    plans, offset = [], 0
    for rank, count in enumerate(rows):
        items = [shard("opt.exp_avg", [offset], [count], [12])]
        offset += count
        items.append(shard("w2d", [0, 3 * rank], [4, 3], [4, 12]))
        items.append(shard(f"expert{rank}.w", [0, 0], [2, 2], [2, 2], dtype=torch.bfloat16))
        items.append(blob(f"obj/shard_{rank}"))
        items.append(shard("tail", [6], [0], [6]))  # empty on every rank, at the end
        plans.append(SavePlan(items))
    plans[0].items.append(shard("tail", [0], [6], [6]))
    return plans


def test_same_metadata_as_dcp_for_uneven_shards_with_empty_chunks():
    plans = _uneven_plans()
    ours, theirs = build_metadata(plans), dcp_metadata(plans)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)  # same order
    assert ours.planner_data == theirs.planner_data and ours.storage_data is None
    chunks = ours.state_dict_metadata["opt.exp_avg"].chunks
    # rank 1's empty chunk at rank 2's offset is left out; rank 3's, at the end, listed
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((0,), (7,)), ((7,), (5,)), ((12,), (0,))]
    assert len(ours.state_dict_metadata["tail"].chunks) == 2  # one empty, one with data


def test_the_chunks_are_the_items_own_objects():
    plans = _uneven_plans()
    chunk = build_metadata(plans).state_dict_metadata["w2d"].chunks[2]
    assert chunk is plans[2].items[1].tensor_data.chunk


def test_the_strategy_planner_gets_the_fast_build_and_its_metadata_set():
    plans = _uneven_plans()
    planner = generation.create_save_planner(TorchDistSaveConfig())
    assert plans_globally_like_dcp(planner)  # megatron-core's planner adds nothing to global planning
    metadata = build_global_metadata(planner, plans)
    assert planner.metadata is metadata
    assert metadata.state_dict_metadata == dcp_metadata(plans).state_dict_metadata


def test_a_planner_with_its_own_global_planning_is_planned_centrally(tmp_path):
    calls = []

    class Custom(DefaultSavePlanner):
        can_run_decentralized_global_plan = True

        def create_global_plan(self, all_plans):
            calls.append(len(all_plans))
            return super().create_global_plan(all_plans)

        def create_decentralized_global_plan(self, local_plan):
            raise AssertionError("a planner with its own global planning is run centrally")

    assert not plans_globally_like_dcp(Custom(flatten_state_dict=False))
    assert not plans_globally_like_dcp(DefaultSavePlanner(flatten_state_dict=True))
    writer = FileSystemWriterAsync(str(tmp_path))
    assert writer.can_run_decentralized_global_plan
    result = state_dict_saver.plan_save({"w": torch.ones(4)}, writer, planner=Custom(flatten_state_dict=False))
    assert calls == [1]
    assert list(result.metadata.state_dict_metadata) == ["w"]


def _refused_by_dcp(plans: List[SavePlan]) -> str:
    with pytest.raises(ValueError) as info:
        dcp_metadata(plans)
    return str(info.value)


@pytest.mark.parametrize(
    "plans, ours, dcp",
    [
        # Elements 10..20 on both ranks (different offsets: not a duplicate item).
        ([SavePlan([shard("a", [0], [20], [30])]), SavePlan([shard("a", [10], [20], [30])])],
         "overlapping chunks at offsets", "overlapping"),
        # 2-D: the boxes overlap in both axes.
        ([SavePlan([shard("m", [0, 0], [4, 4], [8, 8]), shard("m", [4, 4], [4, 4], [8, 8])]),
          SavePlan([shard("m", [2, 2], [4, 4], [8, 8]), shard("m", [0, 4], [4, 4], [8, 8])])],
         "overlapping chunks", "overlapping"),
        # An empty chunk strictly inside another rank's chunk: DCP's box test calls it overlapping.
        ([SavePlan([shard("e", [0], [10], [10])]), SavePlan([shard("e", [4], [0], [10])])],
         "overlapping chunks at offsets (4,) and (0,)", "overlapping"),
        ([SavePlan([shard("b", [0], [10], [10])]), SavePlan([shard("b", [8], [4], [10])])],
         "out of bounds", "out of bounds"),
        ([SavePlan([shard("c", [0], [10], [30])]), SavePlan([shard("c", [20], [10], [30])])],
         "invalid fill", "invalid fill"),
    ],
)
def test_invalid_layouts_are_refused_as_dcp_refuses_them(plans, ours, dcp):
    assert dcp in _refused_by_dcp(plans)
    with pytest.raises(CheckpointValidationError, match="invalid global save plan") as info:
        build_metadata(plans)
    assert ours in str(info.value)


def test_an_empty_chunk_at_the_end_of_another_does_not_overlap():
    plans = [SavePlan([shard("e", [0], [10], [10])]), SavePlan([shard("e", [10], [0], [10])])]
    assert build_metadata(plans).state_dict_metadata == dcp_metadata(plans).state_dict_metadata


def test_one_rank_need_not_fill_its_tensors():
    plans = [SavePlan([shard("c", [0], [10], [30])])]  # DCP checks the fill with several ranks only
    assert build_metadata(plans).state_dict_metadata == dcp_metadata(plans).state_dict_metadata


def test_an_item_planned_by_two_ranks_names_both():
    plans = [SavePlan([shard("a", [0], [5], [10]), shard("a", [5], [5], [10])]),
             SavePlan([shard("a", [5], [5], [10])])]
    with pytest.raises(CheckpointValidationError, match=r"a at offset \(5,\) on ranks \[0, 1\]"):
        build_metadata(plans)


def test_an_object_saved_by_two_ranks_is_refused():
    with pytest.raises(CheckpointValidationError, match="more than one rank"):
        build_metadata([SavePlan([blob("obj")]), SavePlan([blob("obj")])])


def test_a_whole_tensor_planned_twice_on_one_name_is_refused():
    whole = shard("t", [0], [4], [4], kind=WriteItemType.TENSOR)
    with pytest.raises(CheckpointValidationError, match="saved whole by more than one rank"):
        build_metadata([SavePlan([blob("t")]), SavePlan([whole])])


def test_many_errors_are_counted_not_all_listed():
    plans = [SavePlan([shard(f"t{i}", [0], [1], [2]) for i in range(8)]), SavePlan([])]
    with pytest.raises(CheckpointValidationError, match=r"\(and 3 more\)"):
        build_metadata(plans)


def test_equal_chunk_sizes_and_properties_are_pickled_once():
    plans = _uneven_plans()
    ours, theirs = build_metadata(plans), dcp_metadata(plans)
    experts = [ours.state_dict_metadata[f"expert{rank}.w"] for rank in range(4)]
    assert all(e.properties is experts[0].properties for e in experts)
    assert all(e.chunks[0].sizes is experts[0].chunks[0].sizes for e in experts)
    assert ours.state_dict_metadata["w2d"].properties is not experts[0].properties  # float32
    ours_bytes, theirs_bytes = io.BytesIO(), io.BytesIO()
    torch.save(ours, ours_bytes)
    torch.save(theirs, theirs_bytes)
    assert len(ours_bytes.getvalue()) < len(theirs_bytes.getvalue())
    assert torch.load(io.BytesIO(ours_bytes.getvalue()), weights_only=False).state_dict_metadata == (
        theirs.state_dict_metadata
    )
