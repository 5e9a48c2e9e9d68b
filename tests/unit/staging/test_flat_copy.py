"""The one-call copy of cached CPU buckets: a snapshot of the sources' current memory, or none."""

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_async.staging import buffers
from megatron_async.staging.buffers import StagingBufferCache, stage_buckets
from megatron_async.staging.flat_copy import FlatCopy
from megatron_async.writer.layout import WriteBucket


def _bucket(sources):
    items = [WriteItem(index=MetadataIndex(f"t{i}"), type=WriteItemType.TENSOR) for i in range(len(sources))]
    return [WriteBucket("/unused", "unused", ([], list(zip(items, sources))))]


def _stage(sources, cache):
    staged = stage_buckets(_bucket(sources), True, "layout", cache)
    copies = [tensor.clone() for _, tensor in staged[0].data[1]]
    staged.release()
    return copies


def _mixed_sources():
    """Odd byte counts (alignment gaps between buffers), several dtypes, a scalar, an
    empty tensor, a view into a larger storage and a parameter."""
    base = torch.arange(100, dtype=torch.float32)
    return [
        torch.arange(7, dtype=torch.int8),
        torch.rand(3, 5, dtype=torch.float64),
        torch.tensor(True),
        torch.empty(0),
        base[10:30],
        torch.nn.Parameter(torch.rand(4, 4)),
        torch.ones(3, dtype=torch.bfloat16),
    ]


def _assert_snapshot(copies, sources):
    for copy, source in zip(copies, sources):
        assert copy.dtype == source.dtype and copy.shape == source.shape
        assert torch.equal(copy, source.detach())


def test_warm_saves_stage_the_values_at_each_save(monkeypatch):
    cache = StagingBufferCache()
    sources = _mixed_sources()
    _assert_snapshot(_stage(sources, cache), sources)

    def per_tensor_copy(*args, **kwargs):
        raise AssertionError("a cached bucket of contiguous CPU tensors is copied in one call")

    monkeypatch.setattr(buffers, "copy_batched", per_tensor_copy)
    for step in range(3):
        with torch.no_grad():
            for source in sources:
                if source.numel() and source.dtype != torch.bool:
                    source.add_(step + 1)
        expected = [source.detach().clone() for source in sources]
        _assert_snapshot(_stage(sources, cache), expected)
    cache.clear(include_in_use=True)


@pytest.mark.parametrize(
    "change",
    [
        "new_memory",  # .data replaced: the flat view would read the old storage
        "transposed",  # t_() keeps the address and the shape of a square tensor
        "resized",  # resize_ keeps the address
        "other_tensor",  # another tensor object in the same place of the bucket
    ],
)
def test_a_source_changed_in_place_is_staged_from_its_new_memory(change):
    cache = StagingBufferCache()
    sources = [torch.rand(4, 4), torch.rand(16)]
    _stage(sources, cache)
    _stage(sources, cache)  # the one-call copy served a save
    if change == "new_memory":
        sources[0].data = torch.full((4, 4), 5.0)
    elif change == "transposed":
        sources[0].t_()
    elif change == "resized":
        sources[1].resize_(8)
        sources[1].resize_(16)  # the same shape again: the buffers still fit
        sources[1].fill_(3.0)
    else:
        sources[1] = torch.full((16,), 9.0)
    expected = [source.clone() for source in sources]
    _assert_snapshot(_stage(sources, cache), expected)
    _assert_snapshot(_stage(sources, cache), expected)
    cache.clear(include_in_use=True)


def test_non_contiguous_sources_are_staged_without_it():
    cache = StagingBufferCache()
    base = torch.rand(6, 6)
    sources = [base[:, 1], torch.rand(5)]
    assert FlatCopy.build(sources, [torch.empty(6), torch.empty(5)], torch.empty(128, dtype=torch.uint8)) is None
    for _ in range(2):
        base.add_(1.0)
        _assert_snapshot(_stage(sources, cache), [source.clone() for source in sources])
    cache.clear(include_in_use=True)


def test_sources_in_new_memory_at_every_save_are_staged_correctly():
    cache = StagingBufferCache()
    for step in range(4):
        sources = [torch.full((9,), float(step)), torch.full((3, 3), float(-step))]
        _assert_snapshot(_stage(sources, cache), sources)
    cache.clear(include_in_use=True)
