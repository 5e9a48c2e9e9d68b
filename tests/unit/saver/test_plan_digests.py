"""Every rank's plan as a digest in ``.metadata``: what a resumed job compares its plan with."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from megatron_async.mcore import generation
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.saver.global_metadata import build_global_metadata
from megatron_async.saver.metadata_cache import PLAN_DIGESTS_ATTR, loaded_plans, plan_digest, same_plan

pytestmark = pytest.mark.timeout(120)


def item(fqn="w", offset=(0,), size=(4,), whole=(8,), dtype=torch.float32, hint=None) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, list(offset), hint),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(size)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(whole),
        ),
    )


def plans():
    return [SavePlan([item(offset=(0,)), item("b", (0, 0), (2, 2), (2, 2))]), SavePlan([item(offset=(4,))])]


def test_the_digest_ignores_storage_data_and_index_hints_and_survives_pickling():
    plan = plans()[0]
    other = SavePlan([item(offset=(0,), hint=3), item("b", (0, 0), (2, 2), (2, 2), hint=0)],
                     storage_data="prefix")
    assert plan_digest(plan) == plan_digest(other) == plan_digest(pickle.loads(pickle.dumps(plan)))
    assert len(plan_digest(plan)) == 16


@pytest.mark.parametrize(
    "changed",
    [
        dict(fqn="v"), dict(offset=(1,)), dict(size=(3,)), dict(whole=(9,)), dict(dtype=torch.bfloat16),
    ],
)
def test_the_digest_changes_with_the_plan(changed):
    assert plan_digest(SavePlan([item()])) != plan_digest(SavePlan([item(**changed)]))
    assert not same_plan(SavePlan([item(**changed)]), plan_digest(SavePlan([item()])))


def test_the_digest_sees_the_other_plan_fields_and_the_order():
    base = SavePlan([item(), item("b")])
    assert plan_digest(base) != plan_digest(dataclasses.replace(base, usable=False))
    assert plan_digest(base) != plan_digest(SavePlan([item("b"), item()]))


def test_same_plan_compares_digests_or_whole_plans():
    plan = plans()[0]
    assert same_plan(plan, plan_digest(plan))
    assert same_plan(plan, dataclasses.replace(plan, storage_data="x"))  # a cached plan
    assert not same_plan(plan, plans()[1]) and not same_plan(plan, None)


def _metadata():
    return build_global_metadata(generation.create_save_planner(TorchDistSaveConfig()), plans())


def test_the_metadata_stores_one_digest_per_rank_and_no_plans():
    metadata = _metadata()
    assert getattr(metadata, PLAN_DIGESTS_ATTR) == [plan_digest(p) for p in plans()]
    assert not hasattr(metadata, "all_local_plans")
    data = pickle.dumps(metadata)
    assert b"WriteItem" not in data and b"SavePlan" not in data
    assert loaded_plans(pickle.loads(data)) == [plan_digest(p) for p in plans()]


def test_digests_gathered_from_the_ranks_are_stored_as_given():
    given = [b"r" * 16, b"s" * 16]
    metadata = build_global_metadata(generation.create_save_planner(TorchDistSaveConfig()), plans(), given)
    assert getattr(metadata, PLAN_DIGESTS_ATTR) == given


def test_metadata_without_digests_gives_nothing_to_compare():
    class Stock:  # megatron-core's own: whole plans, planned in full on the next save
        all_local_plans = plans()

    assert loaded_plans(Stock()) is None
    assert loaded_plans(None) is None


def test_the_metadata_unpickles_without_this_package(tmp_path):
    path = tmp_path / "metadata.pkl"
    path.write_bytes(pickle.dumps(_metadata()))
    script = (
        "import pickle, sys\n"
        "sys.modules['megatron_async'] = None  # any import of this package fails from here\n"
        "import torch.distributed.checkpoint\n"
        f"md = pickle.load(open({str(path)!r}, 'rb'))\n"
        f"print(len(getattr(md, {PLAN_DIGESTS_ATTR!r})), sorted(md.state_dict_metadata))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                         cwd=str(tmp_path), env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2 ['b', 'w']"
