"""Saves whose structure did not change reuse the previous plan without planning (one rank).

The saves run in this process on a one-rank gloo group; every checkpoint is read back
through megatron-core's ``dist_checkpointing.load`` and through plain PyTorch DCP
(``dcp_to_torch_save``, which loads every tensor whole and every object).
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from megatron_async.core import coordination
from megatron_async.saver.metadata_cache import PLAN_DIGESTS_ATTR, plan_digest
from megatron_async.mcore.structure import bind_plan, describe_structure, rebind
from megatron_async.buckets.layout import PreparedWrite, WriteBucket
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy, TorchDistSaveConfig

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_rank_group")]


# -- the state dict --------------------------------------------------------------------


def _values(step: float, **change):
    """Every saved tensor as a whole (this one rank holds all of it), deterministic in ``step``."""
    rows, cols = change.get("shape", (4, 3))
    values = {
        "w": (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + step).to(
            change.get("dtype", torch.float32)
        ),
        "bf": (torch.linspace(0, 1, 6) * step).to(torch.bfloat16),
        "stacked": torch.arange(10.0).reshape(1, 2, 5) * step,  # one layer on a prepended axis
        "view": torch.arange(12.0).reshape(3, 4).t().contiguous() - step,  # saved from a .t() view
        "split": torch.arange(8.0) * step,  # two shards of one key on this rank
        "layer.0": torch.full((2,), step),
        "layer.1": torch.full((3,), -step),
        "dup": torch.full((3,), step),  # two copies on this rank, one of them the main one
    }
    if change.get("extra_key"):
        values["extra"] = torch.full((5,), 2 * step)
    if change.get("drop_key"):
        del values["bf"]
    return values


def _objects(step: float, **change):
    objects = {"obj": {"step": step, "tag": f"save-{step}"}}
    if change.get("extra_object"):
        objects["obj2"] = [step, "second"]
    return objects


def _state(step: float, **change):
    """This rank's sharded state dict, with every kind of shard megatron-core translates.

    Args:
        step: the values; every save of a test uses another one.
        change: structural changes: ``shape``, ``dtype``, ``extra_key``, ``drop_key``,
            ``swap_offsets`` (the two shards of "split" trade places in the state dict),
            ``swap_replicas`` (the other copy of "dup" becomes the main one),
            ``extra_object``; ``single_copy`` drops the second copy of "dup".
    """
    v = _values(step, **change)
    halves = (1, 0) if change.get("swap_offsets") else (0, 1)
    main = 1 if change.get("swap_replicas") else 0  # which copy of "dup" is the main one
    copies = [v["dup"] + 100, v["dup"] + 100]  # the non-main copy is stale: never saved
    copies[main] = v["dup"]
    state = {
        "w": ShardedTensor.from_rank_offsets("w", v["w"].clone()),
        "stacked": ShardedTensor.from_rank_offsets(
            "stacked", v["stacked"][0].clone(), (0, 0, 1), prepend_axis_num=1
        ),
        "view": ShardedTensor.from_rank_offsets("view", v["view"].t().contiguous().t()),
        "split": [
            ShardedTensor.from_rank_offsets("split", v["split"].chunk(2)[i].clone(), (0, i, 2))
            for i in halves
        ],
        "nested": {
            "layers": [
                ShardedTensor.from_rank_offsets(key, v[key].clone())
                for key in ("layer.0", "layer.1")
            ]
        },
        "dup_a": ShardedTensor.from_rank_offsets("dup", copies[0].clone(), replica_id=main),
        "dup_b": ShardedTensor.from_rank_offsets("dup", copies[1].clone(), replica_id=1 - main),
        "common_value": step,
    }
    if change.get("single_copy"):
        del state["dup_b"]
    if "bf" in v:
        state["bf"] = ShardedTensor.from_rank_offsets("bf", v["bf"].clone())
    if "extra" in v:
        state["extra"] = ShardedTensor.from_rank_offsets("extra", v["extra"].clone())
    for key, value in _objects(step, **change).items():
        state[key] = ShardedObject(key, value, (1,), (0,))
    return state


# -- saving and checking --------------------------------------------------------------


class _Saver:
    """Saves in turn with one strategy, each into a new directory, and checks each checkpoint."""

    def __init__(self, tmp_path, **options):
        self.tmp_path = tmp_path
        self.strategy = TorchDistAsyncSaveStrategy(cached_metadata=True, **options)
        self.saves = 0

    def save(self, step: float, **change):
        """Save ``_state(step, **change)``; return ``(reused without planning, plans gathered)``."""
        path = str(self.tmp_path / f"save{self.saves}")
        self.saves += 1
        os.makedirs(path)
        reused, gathered = self.strategy.plan_cache.structure_reuse_count, coordination.gather_count("plan")
        request = dist_checkpointing.save(
            _state(step, **change),
            path,
            sharded_strategy=self.strategy,
            async_sharded_save=True,
            validate_access_integrity=self.saves == 1,  # later saves skip it, as Megatron-LM's do
        )
        request.execute_sync()
        counts = (
            self.strategy.plan_cache.structure_reuse_count - reused,
            coordination.gather_count("plan") - gathered,
        )
        _check_checkpoint(path, step, **change)
        return counts


def _check_checkpoint(path: str, step: float, **change) -> None:
    """The checkpoint holds exactly ``_state(step, **change)``, for both loaders."""
    values, objects = _values(step, **change), _objects(step, **change)

    loaded = dist_checkpointing.load(_state(-1.0, **change), path)
    assert loaded["common_value"] == step
    assert loaded["w"].dtype == values["w"].dtype and torch.equal(loaded["w"], values["w"])
    assert torch.equal(loaded["stacked"], values["stacked"][0])
    assert torch.equal(loaded["view"], values["view"])
    halves = values["split"].chunk(2)
    order = (1, 0) if change.get("swap_offsets") else (0, 1)
    assert torch.equal(torch.cat(loaded["split"]), torch.cat([halves[i] for i in order]))
    assert torch.equal(loaded["nested"]["layers"][0], values["layer.0"])
    assert torch.equal(loaded["nested"]["layers"][1], values["layer.1"])
    for key in ("dup_a", "dup_b")[: 1 if change.get("single_copy") else 2]:
        assert torch.equal(loaded[key], values["dup"]), key
    for key in ("bf", "extra"):
        assert (key in loaded) == (key in values), key
        if key in values:
            assert torch.equal(loaded[key], values[key]), key
    for key, expected in objects.items():
        assert loaded[key] == expected, (key, loaded[key])

    whole = _load_dcp(path)
    tensors = {k: t for k, t in whole.items() if isinstance(t, torch.Tensor)}
    assert set(tensors) == set(values), sorted(tensors)
    for key, tensor in values.items():
        assert tensors[key].dtype == tensor.dtype and torch.equal(tensors[key], tensor), key
    stored = {k.split("/")[0]: v for k, v in whole.items() if not isinstance(v, torch.Tensor)}
    # megatron-core 0.17+ stores the non-sharded state as one more object.
    stored.pop("common_state", None)
    assert stored == {k: [v] for k, v in objects.items()}, stored


def _load_dcp(path: str):
    """Load every tensor whole and every object with plain PyTorch DCP (no megatron-core)."""
    converted = f"{path}.pt"
    dcp_to_torch_save(path, converted)
    return torch.load(converted, weights_only=False)


# -- the fingerprint --------------------------------------------------------------------

_CHANGES = [
    {"shape": (5, 3)},
    {"dtype": torch.float64},
    {"extra_key": True},
    {"drop_key": True},
    {"swap_offsets": True},
    {"swap_replicas": True},
    {"extra_object": True},
]


def _name(change) -> str:
    return "-".join(change)


def _sharded(step: float, **change):
    """The part of ``_state`` that megatron-core hands to the strategy."""
    state = _state(step, **change)
    del state["common_value"]
    return state


def test_fingerprint_ignores_values_and_sees_every_structural_change():
    base = describe_structure(_sharded(1.0)).fingerprint
    assert describe_structure(_sharded(7.0)).fingerprint == base
    for change in _CHANGES:
        assert describe_structure(_sharded(1.0, **change)).fingerprint != base, change


def test_an_unchanged_fingerprint_is_the_previous_object_and_a_changed_one_is_new():
    previous = describe_structure(_sharded(1.0)).fingerprint
    same = describe_structure(_sharded(5.0), previous)
    assert same.fingerprint is previous  # nothing kept twice across saves
    for change in _CHANGES:
        changed = describe_structure(_sharded(1.0, **change), previous)
        assert changed.fingerprint is not previous and changed.fingerprint != previous, change
        assert changed.fingerprint == describe_structure(_sharded(1.0, **change)).fingerprint


def test_structure_holds_the_data_in_traversal_order():
    state = _sharded(3.0)
    structure = describe_structure(state)
    assert len(structure.sources) == len(structure.fingerprint) == 11
    assert structure.sources[0] is state["w"].data
    assert structure.sources[3] is state["split"][0].data
    assert structure.sources[-1] == state["obj"].data


@pytest.mark.parametrize(
    "state",
    [
        {"plain": torch.zeros(2)},
        {"empty": []},
        {"tuple": (ShardedTensor.from_rank_offsets("t", torch.zeros(2)),)},
        {"no_data": ShardedTensor.from_rank_offsets("t", torch.zeros(2)).without_data()},
    ],
    ids=["plain-tensor", "empty-list", "tuple", "no-data"],
)
def test_state_dicts_megatron_core_refuses_have_no_structure(state):
    assert describe_structure(state) is None


# -- saving -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{}, {"use_cached_data_structure": True, "thread_count": 3}],
    ids=["default", "cached-data-structure"],
)
def test_unchanged_structure_skips_planning_and_writes_the_new_data(tmp_path, options):
    saver = _Saver(tmp_path, **options)
    assert saver.save(1.0) == (0, 1)
    # New values in new tensors (and new objects), same structure: no planning at all,
    # and each checkpoint holds its own save's values (checked by _Saver.save).
    assert saver.save(2.0) == (1, 0)
    assert saver.save(3.0) == (1, 0)
    assert saver.strategy.plan_cache.last_save_reused_plans


@pytest.mark.parametrize("change", _CHANGES, ids=_name)
def test_a_structural_change_plans_in_full_then_skips_again(tmp_path, change):
    # A change that leaves the local plan as it was (only which copy of "dup" is the main
    # one) is planned locally and compared, and the cached plans are reused: no gather.
    gathers = 0 if "swap_replicas" in change else 1
    saver = _Saver(tmp_path)
    assert saver.save(1.0) == (0, 1)
    assert saver.save(2.0) == (1, 0)
    assert saver.save(3.0, **change) == (0, gathers)
    assert saver.save(4.0, **change) == (1, 0)
    assert saver.save(5.0) == (0, gathers)


def test_sharded_object_content_is_serialized_at_every_save(tmp_path):
    saver = _Saver(tmp_path)
    assert saver.save(1.0, extra_object=True) == (0, 1)
    # Only the objects' content changes: the plan is reused and the new content written.
    for step in (2.0, 3.0):
        assert saver.save(step, extra_object=True) == (1, 0)


def test_other_options_plan_again(tmp_path):
    saver = _Saver(tmp_path)
    assert saver.save(1.0) == (0, 1)
    saver.strategy.config = TorchDistSaveConfig(cached_metadata=True, thread_count=3)
    # Planned locally again; the metadata still fits (its stored local plans equal the
    # fresh ones), so nothing is gathered.
    assert saver.save(2.0) == (0, 0)
    assert saver.save(3.0) == (1, 0)


def test_metadata_replaced_by_the_caller_is_verified_not_reused_blindly(tmp_path):
    other = _Saver(tmp_path / "other")
    other.save(1.0, extra_key=True)
    saver = _Saver(tmp_path / "ours")
    saver.save(1.0)
    saver.save(2.0)
    # The caller hands over metadata of another structure (say, of a loaded checkpoint).
    saver.strategy.cached_global_metadata = other.strategy.cached_global_metadata
    assert saver.save(3.0) == (0, 1)
    assert saver.save(4.0) == (1, 0)


def _stored_metadata(saver: _Saver, save: int):
    """The ``.metadata`` of one of ``saver``'s checkpoints, as a resumed job loads it."""
    with open(os.path.join(str(saver.tmp_path / f"save{save}"), ".metadata"), "rb") as stream:
        return pickle.load(stream)


def test_a_resumed_job_skips_the_first_gather_with_the_stored_digests(tmp_path):
    first = _Saver(tmp_path / "first")
    first.save(1.0)
    metadata = _stored_metadata(first, 0)
    # One digest per rank, no plans: .metadata is no larger than DCP's for these plans.
    assert not hasattr(metadata, "all_local_plans")
    assert getattr(metadata, PLAN_DIGESTS_ATTR) == [plan_digest(first.strategy.plan_cache.plans.cached_local_plan)]
    resumed = _Saver(tmp_path / "resumed")
    resumed.strategy.cached_global_metadata = metadata
    assert resumed.save(2.0) == (0, 0)  # planned locally, nothing gathered
    assert resumed.save(3.0) == (1, 0)


def test_a_checkpoint_with_whole_plans_makes_the_resumed_job_gather(tmp_path):
    # As written by megatron-core: all_local_plans, no digests; planned like a cold save.
    first = _Saver(tmp_path / "first")
    first.save(1.0)
    metadata = _stored_metadata(first, 0)
    delattr(metadata, PLAN_DIGESTS_ATTR)
    metadata.all_local_plans = [first.strategy.plan_cache.plans.cached_local_plan]
    resumed = _Saver(tmp_path / "resumed")
    resumed.strategy.cached_global_metadata = metadata
    assert resumed.save(2.0) == (0, 1)


def test_a_digest_of_another_plan_makes_the_resumed_job_gather(tmp_path):
    first = _Saver(tmp_path / "first")
    first.save(1.0)
    metadata = _stored_metadata(first, 0)
    setattr(metadata, PLAN_DIGESTS_ATTR, [bytes(16)])
    resumed = _Saver(tmp_path / "resumed")
    resumed.strategy.cached_global_metadata = metadata
    assert resumed.save(2.0) == (0, 1)


def test_central_planning_of_all_replicas_is_reused_too(tmp_path):
    saver = _Saver(tmp_path, keep_only_main_replica=False)
    assert saver.save(1.0, single_copy=True) == (0, 1)
    assert saver.save(2.0, single_copy=True) == (1, 0)


# -- binding a plan ---------------------------------------------------------------------


def _planned(tensor: torch.Tensor, key: str = "t"):
    """A one-item plan for ``key`` and what a writer made of it: one bucket with ``tensor``."""
    item = WriteItem(
        index=MetadataIndex(key, torch.Size([0])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=tensor.shape),
            properties=TensorProperties(dtype=tensor.dtype),
            size=tensor.shape,
        ),
    )
    bucket = WriteBucket("/unused/f.distcp", "f.distcp", ([], [(item, tensor)]))
    return SavePlan(items=[item]), PreparedWrite([bucket], [("", [0])], None)


def test_a_plan_binds_only_where_the_rebinding_gives_the_planned_data():
    data = torch.arange(3.0)
    structure = describe_structure({"t": ShardedTensor.from_rank_offsets("t", data)})
    plan, prepared = _planned(data)
    binding = bind_plan(structure, plan, prepared, True)
    assert binding is not None
    assert rebind(binding, structure)[0][1] is data
    # The planner resolved other memory than the shard's (a layout this module does not
    # know): no binding, every save plans in full.
    plan, prepared = _planned(data.clone())
    assert bind_plan(structure, plan, prepared, True) is None


def test_two_shards_at_one_offset_do_not_bind():
    data = torch.arange(3.0)
    structure = describe_structure(
        {
            "a": ShardedTensor.from_rank_offsets("t", data),
            "b": ShardedTensor.from_rank_offsets("t", data.clone()),
        }
    )
    plan, prepared = _planned(data)
    assert bind_plan(structure, plan, prepared, False) is None
