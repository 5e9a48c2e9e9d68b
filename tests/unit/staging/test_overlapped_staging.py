"""Overlapped staging in one process: the copy runs after scheduling, waits are bounded,
and a saved tensor changed before its copy fails the save instead of tearing it."""

import os
import time

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_async.core.request import run_preload
from megatron_async.errors import CheckpointValidationError, StagingHandOverError, StagingRaceError
from megatron_async.staging.budget import StagingBufferCache
from megatron_async.staging.gate import StagingGate
from megatron_async.staging.overlapped import refuse_overlap_param_gather, wait_for_staging
from megatron_async.staging.stager import BucketStager
from megatron_async.buckets.layout import WriteBucket
from tests.staging_aids import copies_held, staging_in_progress


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ]),
]
"""CPU tensors are copied by a thread; CUDA tensors on a side stream into page-locked memory."""


def _buckets(tensors):
    items = [
        (WriteItem(index=MetadataIndex(f"layer{i}.weight"), type=WriteItemType.TENSOR), t)
        for i, t in enumerate(tensors)
    ]
    return [WriteBucket("/nonexistent/file.distcp", "file.distcp", ([], items))]


def _stage_overlapped(gate, tensors, cache_key=None, cache=None):
    """The request's ``preload_fn`` of an overlapped save, run as our callers run it."""
    return run_preload(BucketStager(gate, _buckets(tensors), overlapped=True, cache=cache,
                                    cache_key=cache_key).stage)


def _staged_values(staged):
    return [buffer.clone() for _, buffer in staged[0].data[1]]


def _read_as_the_writer(staged, gate):
    """Read every item as the background writer does: each waits for its copied mark, and
    the gate is marked done at the end, whatever happened."""
    try:
        (bucket,) = gate.writer_view(staged, 1.0)
        items = bucket.data[1]
        for idx in range(len(items)):
            items.before_item(idx)
    finally:
        gate.mark_done()


def test_the_writer_waits_for_each_item_and_raises_a_failed_copy():
    gate = StagingGate(2)
    gate.start_rounds()
    staged = _buckets([torch.ones(2), torch.ones(2)])
    gate.mark_copied(0)
    gate.mark_copied(1)
    _read_as_the_writer(staged, gate)
    failed = StagingGate(2)
    failed.start_rounds()
    failed.fail("tensor 'x' changed")
    with pytest.raises(StagingRaceError, match="tensor 'x' changed"):
        _read_as_the_writer(staged, failed)


@pytest.mark.parametrize("device", DEVICES)
def test_scheduling_copies_nothing_and_the_copy_is_a_snapshot(device):
    tensors = [torch.full((1000,), float(i), device=device) for i in range(3)]
    gate = StagingGate(len(tensors))
    staged = _stage_overlapped(gate, tensors, "k", StagingBufferCache())
    assert not staging_in_progress()
    assert all(not torch.equal(b, t.cpu()) for b, t in zip(_staged_values(staged), tensors)
               if t.abs().sum() > 0)
    staged.hand_over(os.getpid(), finish=False)
    wait_for_staging(timeout_s=60)
    assert not staging_in_progress()
    _read_as_the_writer(staged, gate)
    for tensor in tensors:  # the guarded point is over: the trainer may change them
        tensor.add_(100)
    for i, value in enumerate(_staged_values(staged)):
        assert torch.equal(value, torch.full((1000,), float(i)))
    staged.release()


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_step_waits_for_the_copy(device):
    params = [torch.nn.Parameter(torch.full((5000,), 2.0, device=device))]
    optimizer = torch.optim.SGD(params, lr=1.0)
    params[0].grad = torch.ones(5000, device=device)
    gate = StagingGate(1)
    staged = _stage_overlapped(gate, [params[0].detach()])
    with copies_held():
        staged.hand_over(os.getpid(), finish=False)
        assert staging_in_progress()
    optimizer.step()  # the global step pre-hook waits for the copy
    _read_as_the_writer(staged, gate)
    assert torch.equal(_staged_values(staged)[0], torch.full((5000,), 2.0))
    assert torch.equal(params[0].detach().cpu(), torch.full((5000,), 1.0))


@pytest.mark.parametrize("device", DEVICES)
def test_a_tensor_changed_before_its_copy_fails_the_save_naming_it(device, monkeypatch):
    from megatron_async.core import coordination

    monkeypatch.setattr(coordination, "get_rank", lambda: 3)
    tensors = [torch.zeros(100, device=device), torch.zeros(100, device=device)]
    gate = StagingGate(len(tensors))
    staged = _stage_overlapped(gate, tensors)
    with copies_held():
        staged.hand_over(os.getpid(), finish=False)
        tensors[1].add_(1)  # no wait: an unguarded in-place update
    wait_for_staging(timeout_s=60)
    with pytest.raises(StagingRaceError, match=r"rank 3: saved tensor 'layer1.weight'.*"
                       r"wait_for_staging\(\)"):
        _read_as_the_writer(staged, gate)


def test_overlap_param_gather_is_refused():
    class DdpConfig:
        overlap_param_gather = True

    class Model:
        ddp_config = DdpConfig()

    with pytest.raises(CheckpointValidationError, match="overlap_param_gather"):
        refuse_overlap_param_gather([Model()])
    refuse_overlap_param_gather([object()])


def test_a_finished_copy_leaves_no_shared_memory_behind():
    # The copy thread outlives its jobs; holding the last one would keep its gate's
    # shared-memory segment, and the staging memory in it, alive for the process's life.
    # Segments that earlier tests left to the process (the staging ledger's reusable pool)
    # are not this test's concern: only the segments this save made must go.
    import gc

    from megatron_async.core.shared_memory import segment_ranges

    gc.collect()
    before = set(segment_ranges())

    def new_segments_outlive_a_bounded_wait():
        # a copy thread may drop its last reference a moment after the copy ended
        deadline = time.monotonic() + 5
        while gc.collect() is not None and set(segment_ranges()) - before:
            if time.monotonic() > deadline:
                return True
            time.sleep(0.05)
        return False

    cache = StagingBufferCache()
    staged = _stage_overlapped(StagingGate(1), [torch.arange(6.0)], "leak-check", cache)
    assert set(segment_ranges()) - before  # the save made a segment of its own
    staged.hand_over(os.getpid(), finish=False)
    wait_for_staging(timeout_s=30.0)
    staged.release()
    cache.clear()
    del staged, cache
    assert not new_segments_outlive_a_bounded_wait()


def test_an_inference_tensor_is_staged_overlapped_without_a_version_check():
    with torch.inference_mode():
        tensor = torch.arange(8.0)  # keeps no version counter
    gate = StagingGate(1)
    staged = _stage_overlapped(gate, [tensor])
    staged.hand_over(os.getpid(), finish=False)
    wait_for_staging(timeout_s=60)
    _read_as_the_writer(staged, gate)
    assert torch.equal(_staged_values(staged)[0], tensor)


def test_overlapped_staging_outside_our_callers_is_refused():
    with pytest.raises(StagingHandOverError, match="without overlap_staging"):
        BucketStager(StagingGate(1), _buckets([torch.ones(4)]), overlapped=True).stage()
    assert not staging_in_progress()
