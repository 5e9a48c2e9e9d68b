"""The one-call copy of cached CPU buckets: a snapshot of the sources' current memory, or none."""

import threading
import time

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_async.staging import buffers, flat_copy
from megatron_async.staging.budget import StagingBufferCache, StagingLedger
from megatron_async.staging.buffers import stage_buckets
from megatron_async.staging.flat_copy import FlatCopy, StagingCopyTimeoutError
from megatron_async.buckets.layout import WriteBucket


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


def _update_and_stage(sources, cache, saves):
    """Change every source in place before each save; each staging is that save's values."""
    for step in range(saves):
        with torch.no_grad():
            for source in sources:
                if source.numel() and source.dtype != torch.bool:
                    source.add_(step + 1)
        expected = [source.detach().clone() for source in sources]
        _assert_snapshot(_stage(sources, cache), expected)
    cache.clear()


def test_warm_saves_stage_the_values_at_each_save(monkeypatch):
    cache = StagingBufferCache()
    sources = _mixed_sources()
    _assert_snapshot(_stage(sources, cache), sources)

    def per_tensor_copy(*args, **kwargs):
        raise AssertionError("a cached bucket of contiguous CPU tensors is copied in one call")

    monkeypatch.setattr(buffers, "copy_batched", per_tensor_copy)
    _update_and_stage(sources, cache, saves=3)


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
    cache.clear()


def test_non_contiguous_sources_are_staged_without_it():
    cache = StagingBufferCache()
    base = torch.rand(6, 6)
    sources = [base[:, 1], torch.rand(5)]
    assert FlatCopy.build(sources, [torch.empty(6), torch.empty(5)], torch.empty(128, dtype=torch.uint8)) is None
    for _ in range(2):
        base.add_(1.0)
        _assert_snapshot(_stage(sources, cache), [source.clone() for source in sources])
    cache.clear()


def test_sources_in_new_memory_at_every_save_are_staged_correctly():
    cache = StagingBufferCache()
    for step in range(4):
        sources = [torch.full((9,), float(step)), torch.full((3, 3), float(-step))]
        _assert_snapshot(_stage(sources, cache), sources)
    cache.clear()


# -- the copy of a large bucket, cut into parts on several threads -----------------------


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_a_large_bucket_copied_in_parts_is_the_same_snapshot(monkeypatch, threads):
    monkeypatch.setattr(flat_copy, "SPLIT_MIN_BYTES", 1)
    monkeypatch.setenv(flat_copy.COPY_THREADS_ENV, str(threads))
    cache = StagingBufferCache()
    sources = _mixed_sources() + [torch.rand(257) for _ in range(40)]
    _stage(sources, cache)
    assert cache._buckets[0].flat.parts == threads  # the split copy is what runs next
    _update_and_stage(sources, cache, saves=2)


def test_parts_cover_the_region_once_in_order(monkeypatch):
    monkeypatch.setattr(flat_copy, "SPLIT_MIN_BYTES", 1)
    pieces = [torch.full((n,), n % 251, dtype=torch.uint8) for n in (5, 1, 300, 17, 64, 64, 2)]
    region = torch.empty(sum(p.numel() for p in pieces), dtype=torch.uint8)
    for threads in (1, 2, 3, 7, 50):
        parts = flat_copy._split(pieces, region, threads)
        assert 1 <= len(parts) <= min(threads, len(pieces))
        assert [p for run, _ in parts for p in run] == pieces
        assert sum(r.numel() for _, r in parts) == region.numel()
        assert [r.data_ptr() for _, r in parts] == sorted(r.data_ptr() for _, r in parts)
        for run, part_region in parts:
            assert part_region.numel() == sum(p.numel() for p in run)
    assert len(flat_copy._split(pieces, region, 2)) == 2


def _split_copy(monkeypatch, parts=2):
    monkeypatch.setattr(flat_copy, "SPLIT_MIN_BYTES", 1)
    sources = [torch.rand(64) for _ in range(8)]
    segment = torch.empty(8 * 256, dtype=torch.uint8)
    buffers = [segment[i * 256:(i + 1) * 256].view(torch.float32) for i in range(8)]
    copy = FlatCopy.build(sources, buffers, segment, threads=parts)
    assert copy.parts == parts
    return copy, sources, buffers


def _patch_cat(monkeypatch, *hooks):
    """torch.cat whose n-th call runs ``hooks[n]()`` first (None: nothing); returns the
    list of the calls that finished, by number."""
    finished, calls, lock = [], [], threading.Lock()
    real_cat = torch.cat

    def cat(pieces, out):
        with lock:
            number = len(calls)
            calls.append(number)
        hook = hooks[number] if number < len(hooks) else None
        if hook is not None:
            hook()
        result = real_cat(pieces, out=out)
        finished.append(number)
        return result

    monkeypatch.setattr(torch, "cat", cat)
    return finished


def _fail():
    raise RuntimeError("copy failed")


def _slow():
    time.sleep(0.3)


def _on_copy_thread(hook):
    """``hook`` for a copy thread; the training thread's call passes straight through."""
    def run():
        if threading.current_thread() is not threading.main_thread():
            hook()
    return run


def test_a_failed_part_fails_the_copy_after_every_other_part_ended(monkeypatch):
    copy, _, _ = _split_copy(monkeypatch, parts=3)
    roles = iter(["fail", "slow"])  # the two copy threads: one fails at once, one is slow
    lock = threading.Lock()

    def copy_thread():
        with lock:
            role = next(roles)
        (_fail if role == "fail" else _slow)()

    finished = _patch_cat(monkeypatch, _on_copy_thread(copy_thread), _on_copy_thread(copy_thread),
                          _on_copy_thread(copy_thread))
    with pytest.raises(RuntimeError, match="copy failed"):
        copy.copy()
    assert len(finished) == 2 and not copy.stuck  # the slow part ended before the raise


def test_a_failed_training_thread_part_waits_for_the_copy_threads(monkeypatch):
    copy, _, _ = _split_copy(monkeypatch, parts=3)

    def training_fails_copy_threads_slow():
        (_slow if threading.current_thread() is not threading.main_thread() else _fail)()

    finished = _patch_cat(monkeypatch, *[training_fails_copy_threads_slow] * 3)
    with pytest.raises(RuntimeError, match="copy failed"):
        copy.copy()
    assert len(finished) == 2 and not copy.stuck  # both copy threads ended first


def _interrupt_first_wait(monkeypatch):
    """A KeyboardInterrupt arrives in the training thread's first wait for a copy thread."""
    real_wait = flat_copy.futures_wait
    calls = []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(flat_copy, "futures_wait", interrupted_once)


def test_an_interrupt_while_waiting_is_raised_after_the_parts_ended(monkeypatch):
    copy, sources, buffers = _split_copy(monkeypatch)
    finished = _patch_cat(monkeypatch, _on_copy_thread(lambda: time.sleep(0.5)),
                          _on_copy_thread(lambda: time.sleep(0.5)))
    _interrupt_first_wait(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        copy.copy()
    assert len(finished) == 2 and not copy.stuck
    for source, buffer in zip(sources, buffers):
        assert torch.equal(source, buffer)


def _stage_with_a_stuck_copy_thread(monkeypatch, training_thread_hook=None, interrupt=False):
    """Stage a cached two-part bucket whose copy thread hangs past its bound; return the
    cache and the event that frees the thread."""
    monkeypatch.setattr(flat_copy, "SPLIT_MIN_BYTES", 1)
    monkeypatch.setattr(flat_copy, "_PART_WAIT_BASE_S", 0.2)
    monkeypatch.setattr(flat_copy, "_MIN_COPY_BYTES_PER_S", 1e12)
    monkeypatch.setenv(flat_copy.COPY_THREADS_ENV, "2")
    cache = StagingBufferCache()
    sources = [torch.rand(257) for _ in range(8)]
    _stage(sources, cache)  # builds the two-part copy of the cached buffers
    stuck = threading.Event()
    real_cat = torch.cat

    def cat(pieces, out):
        if threading.current_thread() is not threading.main_thread():
            stuck.wait(10)
        elif training_thread_hook is not None:
            training_thread_hook()
        return real_cat(pieces, out=out)

    monkeypatch.setattr(torch, "cat", cat)
    if interrupt:
        _interrupt_first_wait(monkeypatch)
    return cache, sources, stuck


@pytest.mark.parametrize(
    "case, raised",
    [("timeout", StagingCopyTimeoutError), ("interrupt", KeyboardInterrupt),
     ("training-thread-error", RuntimeError)],
)
def test_buffers_a_stuck_copy_thread_may_write_into_are_never_leased_again(monkeypatch, case, raised):
    cache, sources, stuck = _stage_with_a_stuck_copy_thread(
        monkeypatch, training_thread_hook=_fail if case == "training-thread-error" else None,
        interrupt=case == "interrupt")
    try:
        with pytest.raises(raised):
            stage_buckets(_bucket(sources), True, "layout", cache)
        assert cache.num_bytes() == 0  # dropped, whatever was raised
    finally:
        stuck.set()
    monkeypatch.undo()
    _assert_snapshot(_stage(sources, cache), sources)  # new buffers serve the next save
    cache.clear()


def test_idle_copy_threads_hold_no_staging_segment(monkeypatch):
    import gc

    from megatron_async.core.shared_memory import segment_ranges

    monkeypatch.setattr(flat_copy, "SPLIT_MIN_BYTES", 1)
    monkeypatch.setenv(flat_copy.COPY_THREADS_ENV, "3")
    cache = StagingBufferCache()
    sources = [torch.rand(300) for _ in range(12)]
    for _ in range(2):  # the second save runs the three-part copy of the cached buffers
        _assert_snapshot(_stage(sources, cache), sources)
    cache.clear()
    StagingLedger.of_process().drop_pool()  # an earlier test's pool of staging in rounds
    deadline = time.monotonic() + 5  # a thread freed by an earlier test may still be ending
    while gc.collect() is not None and segment_ranges() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not segment_ranges()


def test_copy_threads_follow_the_cpus_shared_by_local_ranks(monkeypatch):
    monkeypatch.delenv(flat_copy.COPY_THREADS_ENV, raising=False)
    monkeypatch.setattr(flat_copy.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert flat_copy.copy_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert flat_copy.copy_threads() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert flat_copy.copy_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")  # as without it
    assert flat_copy.copy_threads() == 4
    monkeypatch.setenv(flat_copy.COPY_THREADS_ENV, "1")
    assert flat_copy.copy_threads() == 1
    monkeypatch.setenv(flat_copy.COPY_THREADS_ENV, "64")
    assert flat_copy.copy_threads() == 16
    monkeypatch.setenv(flat_copy.COPY_THREADS_ENV, "many")
    with pytest.raises(ValueError, match=flat_copy.COPY_THREADS_ENV):
        flat_copy.copy_threads()
