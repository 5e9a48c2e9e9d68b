"""Copies of the strategy: same options, caches of their own (one process).

megatron-core's tests ``deepcopy`` the default save strategy and then set
``use_cached_ckpt_structure`` on the copy; the original must not change. The saves here
run in this process on a one-rank gloo group; the multi-rank version with loads through
megatron-core and DCP is ``copies_save_alternately_with_the_original`` in
``tests/functional/scenarios_strategy.py``.
"""

import copy
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing import ShardedTensor

from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]

COPIES = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda strategy: pickle.loads(pickle.dumps(strategy)),
}


def _state(step: float):
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0) + step)}


def _save_and_check(strategy, path, step: float) -> None:
    path.mkdir()
    strategy.save(_state(step), path)
    loaded = {"w": torch.empty(6)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(path))
    assert torch.equal(loaded["w"], torch.arange(6.0) + step)


@pytest.mark.parametrize("make_copy", COPIES.values(), ids=COPIES.keys())
def test_a_copy_has_the_options_and_empty_caches_of_its_own(tmp_path, make_copy):
    original = TorchDistAsyncSaveStrategy(thread_count=3, cached_metadata=True)
    _save_and_check(original, tmp_path / "original-1", 1.0)
    assert original.staging_cache.num_bytes() > 0

    clone = make_copy(original)
    assert type(clone) is TorchDistAsyncSaveStrategy
    assert clone.config == original.config and clone.thread_count == 3
    assert (clone.backend, clone.version) == ("torch_dist", 1)
    assert clone.plan_cache is not original.plan_cache
    assert clone.staging_cache is not original.staging_cache
    assert clone.cached_global_metadata is None and clone.plan_cache.structure_reuse_count == 0
    assert clone.staging_cache.num_bytes() == 0

    # Alternating saves: each strategy reuses only its own plans.
    _save_and_check(clone, tmp_path / "copy-1", 2.0)
    _save_and_check(original, tmp_path / "original-2", 3.0)
    _save_and_check(clone, tmp_path / "copy-2", 4.0)
    assert (original.plan_cache.structure_reuse_count, clone.plan_cache.structure_reuse_count) == (1, 1)


@pytest.mark.parametrize("make_copy", COPIES.values(), ids=COPIES.keys())
def test_options_set_on_a_copy_leave_the_original_alone(make_copy):
    original = TorchDistAsyncSaveStrategy()
    clone = make_copy(original)
    clone.use_cached_ckpt_structure = True  # what megatron-core's tests do after deepcopy
    clone.thread_count = 4
    clone.separation_hint = "optimizer"
    assert original.use_cached_ckpt_structure is False
    assert (original.thread_count, original.separation_hint) == (2, None)
    assert clone.config.cached_metadata and clone.config.thread_count == 4
    original.keep_only_main_replica = False
    assert clone.keep_only_main_replica is True


def test_a_subclass_copies_its_own_attributes():
    class WithWriter(TorchDistAsyncSaveStrategy):
        def __init__(self, writer_name, **options):
            super().__init__(**options)
            self.writer_name = writer_name

    original = WithWriter("slow", thread_count=5)
    clone = copy.deepcopy(original)
    assert type(clone) is WithWriter and clone.writer_name == "slow"
    assert clone.thread_count == 5 and clone.plan_cache is not original.plan_cache
