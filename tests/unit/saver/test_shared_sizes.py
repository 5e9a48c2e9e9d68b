"""share_equal_sizes: one torch.Size object per distinct value, the plan otherwise unchanged."""

import copy
import pickle

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from megatron_async.saver.plan_digests import plan_digest, same_plan
from megatron_async.saver.shared_sizes import share_equal_sizes
from tools.bench.scale import _chunk as _item  # one shard's write item, as DCP's planner makes it


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


def test_index_hashes_are_unchanged():
    plan = _plan(3)
    keys = {item.index: n for n, item in enumerate(plan.items)}
    share_equal_sizes(plan)
    assert all(keys[item.index] == n for n, item in enumerate(plan.items))
