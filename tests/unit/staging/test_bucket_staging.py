"""Staging into shared-memory segments: snapshots, exact-size buffers, reuse, file sizes."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megatron_async.staging.budget import StagingBufferCache
from megatron_async.staging.buffers import stage_buckets
from megatron_async.core import shared_memory
from megatron_async.writer.filesystem import FileSystemWriterAsync
from tests.staging_aids import forget_staging_buffers


def _save(path, state_dict, cached=False):
    writer = FileSystemWriterAsync(str(path), thread_count=1, use_cached_data_structure=cached)
    planner = DefaultSavePlanner(flatten_state_dict=False)
    planner.set_up_planner(state_dict, is_coordinator=True)
    writer.set_up_storage_writer(True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    _, metadata = planner.create_global_plan([local_plan])
    writer.prepare_write_data(planner.finish_plan(writer.prepare_decentralized_global_plan(local_plan)), planner)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    staged = preload_fn()
    save_fn(args[0], staged, args[2])
    staged.release()
    writer.finish(metadata, [writer.retrieve_write_results()])
    return staged


def test_each_staged_tensor_has_a_storage_of_its_own_size(tmp_path):
    """torch.save writes a tensor's whole storage: a plain slice of the segment would write it all."""
    state_dict = {f"t{i}": torch.full((256,), float(i)) for i in range(200)}
    staged = _save(tmp_path, state_dict)
    (bucket,) = staged
    for _item, tensor in bucket.data[1]:
        assert tensor.untyped_storage().nbytes() == 256 * 4
        assert shared_memory.find_segment(tensor) is not None
    data_bytes = sum(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path) if f.endswith(".distcp"))
    # The data plus torch.save's per-item headers, not 200 copies of the bucket's segment.
    assert data_bytes < 200 * (256 * 4 + 4096), data_bytes
    out = {k: torch.empty_like(v) for k, v in state_dict.items()}
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(out[k], state_dict[k]) for k in state_dict)


def test_staging_is_a_snapshot_of_views_and_odd_dtypes():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from megatron_async.buckets.layout import WriteBucket

    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    sources = [base[:, 1], torch.ones(3, dtype=torch.bfloat16), torch.tensor(True), torch.empty(0), torch.tensor(7, dtype=torch.int8)]
    items = [WriteItem(index=MetadataIndex(f"t{i}"), type=WriteItemType.TENSOR) for i in range(len(sources))]
    staged = stage_buckets([WriteBucket("/unused", "unused", ([], list(zip(items, sources))))])
    expected = [s.clone() for s in sources]
    base.add_(100)
    for source in sources:
        source.fill_(0) if source.numel() else None
    copies = [t for _, t in staged[0].data[1]]
    for copy, want in zip(copies, expected):
        assert copy.dtype == want.dtype and copy.shape == want.shape and copy.is_contiguous()
        assert torch.equal(copy, want)
    staged.release()


def test_cached_buffers_are_reused_only_after_release():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from megatron_async.buckets.layout import WriteBucket

    forget_staging_buffers()
    source = torch.zeros(16)
    item = WriteItem(index=MetadataIndex("t"), type=WriteItemType.TENSOR)
    buckets = [WriteBucket("/unused", "unused", ([], [(item, source)]))]
    try:
        first = stage_buckets(buckets, True, "layout")
        busy = stage_buckets(buckets, True, "layout")  # first not released: fresh buffers
        assert first[0].data[1][0][1].data_ptr() != busy[0].data[1][0][1].data_ptr()
        first.release()
        again = stage_buckets(buckets, True, "layout")
        assert again[0].data[1][0][1].data_ptr() == first[0].data[1][0][1].data_ptr()
        busy.release()  # an old lease: must not free the buffers "again" holds
        assert stage_buckets(buckets, True, "layout")[0].data[1][0][1].data_ptr() != again[0].data[1][0][1].data_ptr()
    finally:
        forget_staging_buffers()


def test_staged_data_dropped_unreleased_keeps_its_buffers_until_its_writer_is_done():
    """megatron-core 0.16's own queue keeps no reference to the staged data while the
    writer it forked still reads the buffers: dropping the data must not lend them again;
    the save's gate marked done (the writer's last step) does."""
    import gc

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from megatron_async.buckets.layout import WriteBucket
    from megatron_async.staging.gate import StagingGate

    cache = StagingBufferCache()
    item = WriteItem(index=MetadataIndex("t"), type=WriteItemType.TENSOR)
    buckets = [WriteBucket("/unused", "unused", ([], [(item, torch.zeros(16))]))]

    def pointer(staged):
        return staged[0].data[1][0][1].data_ptr()

    first = stage_buckets(buckets, True, "layout", cache)
    gate = StagingGate(1)
    first.loan.gate = gate  # as the budget's ledger does
    first_pointer = pointer(first)
    del first
    gc.collect()
    while_writing = stage_buckets(buckets, True, "layout", cache)
    assert pointer(while_writing) != first_pointer  # the forked writer still reads those
    while_writing.release()
    gate.mark_done()
    assert pointer(stage_buckets(buckets, True, "layout", cache)) == first_pointer
    cache.clear()


def test_a_full_shared_memory_is_a_typed_error(monkeypatch):
    from megatron_async.errors import StagingMemoryError

    def refuse(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    try:
        shared_memory.allocate_segment(4096)
    except StagingMemoryError as exc:
        assert "shm-size" in str(exc)
    else:
        raise AssertionError("no StagingMemoryError")


def _one_tensor_buckets(source, count=1, name="t"):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from megatron_async.buckets.layout import WriteBucket

    item = WriteItem(index=MetadataIndex(name), type=WriteItemType.TENSOR)
    return [WriteBucket("/unused", f"b{i}", ([], [(item, source)])) for i in range(count)]


def test_a_new_layout_replaces_the_old_one():

    forget_staging_buffers()
    try:
        stage_buckets(_one_tensor_buckets(torch.zeros(1024)), True, "old").release()
        in_flight = stage_buckets(_one_tensor_buckets(torch.zeros(1024)), True, "old")
        in_flight.release()
        stage_buckets(_one_tensor_buckets(torch.zeros(2048)), True, "new").release()
        assert StagingBufferCache.of_process().num_bytes() == 2048 * 4  # not a checkpoint per layout seen
        # A layout replaced while its save was still being written goes at release.
        busy = stage_buckets(_one_tensor_buckets(torch.zeros(2048)), True, "new")
        stage_buckets(_one_tensor_buckets(torch.zeros(512)), True, "newer").release()
        busy.release()
        assert StagingBufferCache.of_process().num_bytes() == 512 * 4
    finally:
        forget_staging_buffers()


def test_a_lease_from_before_a_cache_reset_frees_nothing():
    forget_staging_buffers()
    source = torch.ones(4)
    try:
        old = stage_buckets(_one_tensor_buckets(source), True, "layout")
        forget_staging_buffers()
        current = stage_buckets(_one_tensor_buckets(source), True, "layout")
        old.release()  # must not free the buffers "current" still holds
        source.fill_(2.0)
        later = stage_buckets(_one_tensor_buckets(source), True, "layout")
        assert torch.equal(current[0].data[1][0][1], torch.ones(4))
        assert later[0].data[1][0][1].data_ptr() != current[0].data[1][0][1].data_ptr()
    finally:
        forget_staging_buffers()


def test_a_cached_layout_with_more_buckets_stages_the_extra_ones_fresh():
    forget_staging_buffers()
    try:
        stage_buckets(_one_tensor_buckets(torch.ones(4), 1), True, "layout").release()
        staged = stage_buckets(_one_tensor_buckets(torch.ones(4), 3), True, "layout")
        assert [torch.equal(b.data[1][0][1], torch.ones(4)) for b in staged] == [True] * 3
        staged.release()
    finally:
        forget_staging_buffers()


def _items(count, prefix="t"):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    return [WriteItem(index=MetadataIndex(f"{prefix}{i}"), type=WriteItemType.TENSOR) for i in range(count)]


def _buckets(items, sources):
    from megatron_async.buckets.layout import WriteBucket

    return [WriteBucket("/unused", "unused", ([], list(zip(items, sources))))]


def test_a_warm_save_gets_the_same_staged_pairs_with_the_new_values():
    """The (item, buffer) pairs of a reused layout are one object across saves (the request
    sender encodes them once), and each save still copies the values of its own tensors,
    replaced tensors of the same shape included."""
    from megatron_async.core.shared_memory import ReusedTensorPairs

    forget_staging_buffers()
    items = _items(50)
    sources = [torch.full((8,), float(i)) for i in range(50)]
    first = stage_buckets(_buckets(items, sources), True, "warm")
    pairs = first[0].data[1]
    assert isinstance(pairs, ReusedTensorPairs)
    first.release()

    sources[7] = torch.full((8,), -7.0)  # a tensor replaced by another of the same shape
    sources[8].add_(100.0)  # and one updated in place
    second = stage_buckets(_buckets(items, sources), True, "warm")
    assert second[0].data[1] is pairs
    staged = [tensor for _, tensor in second[0].data[1]]
    assert all(torch.equal(copy, source) for copy, source in zip(staged, sources))
    sources[9].add_(1.0)  # after staging: not in the snapshot
    assert torch.equal(staged[9], torch.full((8,), 9.0))
    second.release()

    # Other item objects (a new plan with the same layout): new pairs over the same buffers.
    third = stage_buckets(_buckets(_items(50), sources), True, "warm")
    assert third[0].data[1] is not pairs
    assert [t.data_ptr() for _, t in third[0].data[1]] == [t.data_ptr() for _, t in pairs]
    third.release()
    forget_staging_buffers()


def test_a_warm_save_whose_tensor_changed_shape_gets_new_buffers():
    forget_staging_buffers()
    items = _items(3)
    sources = [torch.ones(4), torch.ones(4), torch.ones(4)]
    first = stage_buckets(_buckets(items, sources), True, "shape")
    pairs = first[0].data[1]
    first.release()
    sources[1] = torch.arange(6.0)  # same layout key, other shape: never broadcast into 4
    second = stage_buckets(_buckets(items, sources), True, "shape")
    staged = [tensor for _, tensor in second[0].data[1]]
    assert second[0].data[1] is not pairs
    assert torch.equal(staged[1], torch.arange(6.0))
    second.release()
    forget_staging_buffers()


def test_sources_that_require_grad_are_copied_without_autograd():
    items = _items(2)
    sources = [torch.ones(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]
    staged = stage_buckets(_buckets(items, sources))
    copies = [tensor for _, tensor in staged[0].data[1]]
    assert not any(copy.requires_grad for copy in copies)
    assert torch.equal(copies[0], torch.ones(3)) and torch.equal(copies[1], torch.zeros(2, 2))
    staged.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("copies_land", [True, False], ids=["copies-land", "copies-stuck"])
def test_a_staging_failure_lends_the_buffers_again_only_once_the_copies_landed(monkeypatch, copies_land):
    # A failure after the device copies were queued: staging waits for them before it gives
    # the buffers back; if the device is stuck, the buffers are never lent again.
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from megatron_async.core import device_wait
    from megatron_async.staging import buffers
    from megatron_async.buckets.layout import WriteBucket

    forget_staging_buffers()
    item = WriteItem(index=MetadataIndex("t"), type=WriteItemType.TENSOR)
    buckets = [WriteBucket("/unused", "unused", ([], [(item, torch.ones(1 << 20, device="cuda"))]))]
    real_wait, calls = buffers.wait_for_device_copies, []

    def wait(devices, timeout_s=600.0, holding=None):
        calls.append(set(devices))
        if len(calls) == 1:
            raise RuntimeError("injected: a failure after the copies were queued")
        if not copies_land:
            raise device_wait.DeviceCopyTimeoutError("injected: the device made no progress")
        real_wait(devices, timeout_s, holding)

    try:
        stage_buckets(buckets, True, "layout").release()  # the layout's buffers, cached
        monkeypatch.setattr(buffers, "wait_for_device_copies", wait)  # staging's wait
        monkeypatch.setattr(device_wait, "wait_for_device_copies", wait)  # the look after a failure
        with pytest.raises(RuntimeError, match="injected: a failure after"):
            stage_buckets(buckets, True, "layout")
        assert calls == [{torch.device("cuda", torch.cuda.current_device())}] * 2  # then the wait
        assert (StagingBufferCache.of_process().num_bytes() > 0) == copies_land  # the old ones
    finally:
        torch.cuda.synchronize()
        device_wait.release_landed()
        forget_staging_buffers()
