"""share_equal_sizes: one torch.Size object per distinct value, the plan otherwise unchanged."""

import copy
import pickle

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from megatron_async.saver.metadata_cache import plan_digest, same_plan
from megatron_async.saver.global_metadata import share_equal_sizes


def _item(fqn, offsets, sizes, whole):
    """A shard's write item with a new torch.Size per value, as DCP's planner builds it."""
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=chunk, size=torch.Size(whole),
                                                 properties=TensorProperties(dtype=torch.bfloat16)))


def _plan(layers=50):
    items = [_item(f"layer{i}.weight", (128, 0), (128, 64), (256, 64)) for i in range(layers)]
    items += [_item(f"layer{i}.bias", (0,), (7,), (7,)) for i in range(layers)]
    items.append(WriteItem(index=MetadataIndex("rng", None), type=WriteItemType.BYTE_IO))
    return SavePlan(items)


def test_equal_sizes_become_one_object_and_the_plan_compares_digests_and_loads_the_same():
    plan = _plan()
    before = copy.deepcopy(plan)
    size_before = len(pickle.dumps(plan))
    assert share_equal_sizes(plan) is plan
    objects = {id(s) for item in plan.items if item.tensor_data is not None
               for s in (item.index.offset, item.tensor_data.size, item.tensor_data.chunk.offsets,
                         item.tensor_data.chunk.sizes)}
    assert len(objects) == 5  # (128, 0), (128, 64), (256, 64), (0,) and (7,)
    assert plan.items[0].index.offset is plan.items[0].tensor_data.chunk.offsets
    assert plan.items[-1].index.offset is None
    assert same_plan(plan, before) and plan_digest(plan) == plan_digest(before)
    assert pickle.loads(pickle.dumps(plan)) == before
    assert len(pickle.dumps(plan)) < 0.85 * size_before  # 0.80 here; names are the rest


def test_only_torch_size_values_are_shared_and_items_without_tensors_or_chunks_pass():
    plan = _plan(2)
    as_tuple = _item("tuple.weight", (128, 0), (128, 64), (256, 64))
    object.__setattr__(as_tuple.tensor_data.chunk, "sizes", (128, 64))  # a tuple, not a Size
    no_chunk = _item("nochunk.weight", (0,), (7,), (7,))
    object.__setattr__(no_chunk.tensor_data, "chunk", None)
    plan.items.extend([as_tuple, no_chunk])
    share_equal_sizes(plan)
    assert type(as_tuple.tensor_data.chunk.sizes) is tuple
    assert as_tuple.tensor_data.chunk.offsets is plan.items[0].tensor_data.chunk.offsets
    assert no_chunk.tensor_data.chunk is None
    assert no_chunk.tensor_data.size is plan.items[2].tensor_data.size  # (7,), a bias's


def test_write_results_keep_their_shared_offsets_through_pickle():
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from megatron_async.writer.bucket_io import ChecksummedWriteResult, _rebuild_checksummed_result

    plan = share_equal_sizes(_plan(20))
    results = [ChecksummedWriteResult(item.index, 16, _StorageInfo("__0_0.distcp", 16 * n, 16), "ab")
               for n, item in enumerate(plan.items)]
    received = pickle.loads(pickle.dumps(results))  # what the coordinator holds
    assert [r.index for r in received] == [r.index for r in results]
    assert [r.storage_data for r in received] == [r.storage_data for r in results]
    weights = [r.index.offset for r in received if r.index.fqn.endswith("weight")]
    assert len({id(o) for o in weights}) == 1 and type(weights[0]) is torch.Size
    assert received[-1].index.offset is None
    # A tuple offset (a sender before the shared sizes) still becomes a torch.Size.
    old = _rebuild_checksummed_result("x", (4, 0), None, 16, "__0_0.distcp", 0, 16, None, False)
    assert type(old.index.offset) is torch.Size and old.index == MetadataIndex("x", [4, 0])
