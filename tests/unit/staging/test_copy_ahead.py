"""The copy ahead: a cached layout's staging copy started before the save knows its sources."""

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_async.staging import copy_ahead, copy_pool, flat_copy
from megatron_async.staging.buffers import StagingBufferCache, stage_buckets
from megatron_async.staging.copy_ahead import start_copy_ahead
from megatron_async.staging.flat_copy import FlatCopy, StagingCopyTimeoutError
from megatron_async.writer.layout import WriteBucket

KEY = "layout"


def _buckets(groups):
    """One bucket per list of sources; item names are unique across buckets."""
    buckets, n = [], 0
    for sources in groups:
        items = [WriteItem(index=MetadataIndex(f"t{n + i}"), type=WriteItemType.TENSOR)
                 for i in range(len(sources))]
        n += len(sources)
        buckets.append(WriteBucket("/unused", f"b{len(buckets)}", ([], list(zip(items, sources)))))
    return buckets


def _sources():
    # two buckets; the first large enough to be cut into parts for two threads
    big = [torch.rand(64 * 1024) for _ in range(40)]  # 40 x 256 KiB = 10 MiB
    small = [torch.arange(7, dtype=torch.int8), torch.rand(3, 5, dtype=torch.float64)]
    return [big, small]


def _stage(groups, cache, ahead=None):
    staged = stage_buckets(_buckets(groups), True, KEY, cache, copy_ahead=ahead)
    copies = [[t.clone() for _, t in bucket.data[1]] for bucket in staged]
    lease = staged.lease
    staged.release()
    return copies, lease


def _step(groups, value):
    with torch.no_grad():
        for sources in groups:
            for source in sources:
                source.add_(value)


def _assert_equal(copies, groups):
    for bucket_copies, sources in zip(copies, groups):
        assert len(bucket_copies) == len(sources)
        for copy, source in zip(bucket_copies, sources):
            assert torch.equal(copy, source)


@pytest.fixture
def warm_cache(monkeypatch):
    """A cache whose layout has one-call copies, and the sources they read."""
    monkeypatch.setenv(flat_copy.COPY_THREADS_ENV, "3")  # two threads for the copy ahead
    monkeypatch.setenv(copy_ahead.COPY_AHEAD_ENV, "1")
    cache, groups = StagingBufferCache(), _sources()
    _stage(groups, cache)
    yield cache, groups
    cache.clear(include_in_use=True)


def _no_copy_at_staging(monkeypatch):
    """Make a copy at staging time fail the test: the copy ahead must have done it."""
    def refuse(self):
        raise AssertionError("staging copied although the copy ahead did")
    monkeypatch.setattr(FlatCopy, "copy", refuse)


def test_staging_uses_the_copy_started_ahead_and_gets_the_current_values(warm_cache, monkeypatch):
    cache, groups = warm_cache
    for value in (1, 2):
        _step(groups, value)
        ahead = start_copy_ahead(cache, KEY)
        assert ahead is not None and sorted(ahead.parts) == [0, 1]
        generation = cache._entries[KEY].generation  # the lease the copy ahead took
        with monkeypatch.context() as patch:
            _no_copy_at_staging(patch)
            copies, lease = _stage(groups, cache, ahead)
        assert ahead.claimed and lease == (KEY, generation)
        _assert_equal(copies, groups)
    assert cache.lease(KEY, 2) is not None  # the lease went back


def test_sources_in_new_memory_are_copied_anew(warm_cache):
    cache, groups = warm_cache
    ahead = start_copy_ahead(cache, KEY)
    moved = [[source + 5 for source in sources] for sources in groups]  # same shapes, new memory
    copies, _ = _stage(moved, cache, ahead)
    assert ahead.claimed
    _assert_equal(copies, moved)
    _step(moved, 1)  # the rebuilt copies read the new memory from now on
    copies, _ = _stage(moved, cache, start_copy_ahead(cache, KEY))
    _assert_equal(copies, moved)


def test_sources_changed_in_place_after_the_start_are_copied_anew(warm_cache):
    cache, groups = warm_cache
    ahead = start_copy_ahead(cache, KEY)
    for _, running in ahead.parts.values():  # the copy ahead is done: it holds the old values
        for future, _ in running:
            future.result(timeout=30)
    with torch.no_grad():
        groups[0][3].mul_(-1)  # one tensor of the large bucket, after the copy started
        groups[1][0].add_(2)
    copies, _ = _stage(groups, cache, ahead)
    assert ahead.claimed
    _assert_equal(copies, groups)


def test_only_the_save_that_started_it_may_use_it(warm_cache):
    cache, groups = warm_cache
    ahead = start_copy_ahead(cache, KEY)
    _step(groups, 3)
    copies, lease = _stage(groups, cache)  # another save: the copy ahead holds the buffers
    assert lease is None and not ahead.claimed
    _assert_equal(copies, groups)
    ahead.cancel()
    assert cache.lease(KEY, 2) is not None


@pytest.mark.parametrize("how", ["next_copy_ahead", "clear", "other_layout", "cancel"])
def test_an_unclaimed_copy_is_cancelled_and_gives_the_lease_back(warm_cache, how):
    cache, groups = warm_cache
    stale = start_copy_ahead(cache, KEY)
    if how == "next_copy_ahead":
        fresh = start_copy_ahead(cache, KEY)
        assert fresh is not None and fresh is not stale
        _step(groups, 4)
        copies, lease = _stage(groups, cache, stale)  # the stale one cannot claim the lease
        assert lease is None and not stale.claimed
        _assert_equal(copies, groups)
        fresh.cancel()
    elif how == "clear":
        cache.clear()
        assert cache.num_bytes() == 0 and not stale.parts  # its buffers count as idle
        return
    elif how == "other_layout":
        staged = stage_buckets(_buckets(groups), True, "another layout", cache, copy_ahead=stale)
        staged.release()
    else:
        stale.cancel()
        stale.cancel()  # twice is harmless
    assert not stale.parts and not stale.claimed and cache.unclaimed_aheads() == []
    assert cache.lease(KEY, 2) is not None


def test_an_interrupt_while_cancelling_waits_for_every_bucket_first(warm_cache, monkeypatch):
    cache, _ = warm_cache
    ahead = start_copy_ahead(cache, KEY)
    futures = [future for _, running in ahead.parts.values() for future, _ in running]
    settled, original = [], FlatCopy.settle

    def interrupted_once(self, running):
        original(self, running)
        settled.append(self)
        if len(settled) == 1:
            raise KeyboardInterrupt  # arrived while waiting for the first bucket

    monkeypatch.setattr(FlatCopy, "settle", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        ahead.cancel()
    assert len(settled) == 2 and all(future.done() for future in futures)
    assert cache.lease(KEY, 2) is not None  # given back once both had ended


def test_nothing_starts_while_a_save_holds_the_buffers_or_when_turned_off(warm_cache, monkeypatch):
    cache, _ = warm_cache
    assert start_copy_ahead(cache, None) is None
    held = cache.lease(KEY, 2)
    assert start_copy_ahead(cache, KEY) is None
    cache.release((KEY, held.generation))
    monkeypatch.setenv(copy_ahead.COPY_AHEAD_ENV, "0")
    assert start_copy_ahead(cache, KEY) is None
    monkeypatch.delenv(copy_ahead.COPY_AHEAD_ENV)  # off by default
    assert start_copy_ahead(cache, KEY) is None
    monkeypatch.setenv(copy_ahead.COPY_AHEAD_ENV, "1")
    monkeypatch.setenv(flat_copy.COPY_THREADS_ENV, "1")  # the training thread copies alone
    assert start_copy_ahead(cache, KEY) is None
    monkeypatch.setenv(flat_copy.COPY_THREADS_ENV, "2")
    assert start_copy_ahead(cache, "another layout") is None
    assert start_copy_ahead(cache, KEY) is not None


def _fail_second_start(patch, fail):
    """Let the first bucket's :meth:`FlatCopy.start` run; ``fail(flat)`` raises in the
    second's. Returns the list that receives the first bucket's running parts."""
    started, original = [], FlatCopy.start

    def start(self, threads, running=None):
        if started:
            fail(self)
        started.append(original(self, threads, running))
        return started[-1]

    patch.setattr(FlatCopy, "start", start)
    return started


def test_a_failure_while_starting_is_no_copy_ahead_and_leaks_nothing(warm_cache, monkeypatch):
    # The copy ahead only speeds a save up: a failure while it starts (here the second
    # bucket's start, after the first bucket's parts are running) must not fail the save.
    cache, groups = warm_cache

    def fail(flat):
        raise RuntimeError("could not start")

    with monkeypatch.context() as patch:
        started = _fail_second_start(patch, fail)
        assert start_copy_ahead(cache, KEY) is None
    assert started and started[0]  # the first bucket's parts went to the copy threads
    assert all(future.done() for future, _ in started[0])  # settled, not left running
    assert cache.unclaimed_aheads() == []
    held = cache.lease(KEY, 2)  # the lease went back
    assert held is not None
    cache.release((KEY, held.generation))
    _step(groups, 1)
    ahead = start_copy_ahead(cache, KEY)
    assert ahead is not None  # and the copy ahead works again
    copies, _ = _stage(groups, cache, ahead)
    _assert_equal(copies, groups)


def test_a_start_stuck_past_its_bound_drops_the_buffers(warm_cache, monkeypatch):
    # A part of the second bucket is still running past its bound when its start fails:
    # a copy thread may write into the layout's buffers, so nobody may lease them again.
    cache, groups = warm_cache

    def stuck(flat):
        flat.stuck = True  # as FlatCopy.settle marks a part past its bound
        raise StagingCopyTimeoutError("a part is stuck")

    with monkeypatch.context() as patch:
        _fail_second_start(patch, stuck)
        assert start_copy_ahead(cache, KEY) is None
    assert cache.unclaimed_aheads() == [] and cache.num_bytes() == 0  # dropped, not lent again
    copies, _ = _stage(groups, cache)
    _assert_equal(copies, groups)


def test_an_interrupt_while_starting_is_raised_and_leaks_nothing(warm_cache, monkeypatch):
    cache, _ = warm_cache

    def interrupt(flat):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        started = _fail_second_start(patch, interrupt)
        with pytest.raises(KeyboardInterrupt):
            start_copy_ahead(cache, KEY)
    assert started[0] and all(future.done() for future, _ in started[0])
    assert cache.unclaimed_aheads() == []
    held = cache.lease(KEY, 2)
    assert held is not None
    cache.release((KEY, held.generation))


def test_an_interrupt_right_after_leasing_leaves_a_lease_the_next_start_gives_back(
    warm_cache, monkeypatch
):
    # Between the cache lending the buffers and the copy ahead's own bookkeeping: the
    # lease is recorded on the cache entry, so the next start cancels it and leases anew.
    cache, groups = warm_cache
    original = StagingBufferCache.lease_ahead

    def interrupted(self, key, ahead):
        original(self, key, ahead)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(StagingBufferCache, "lease_ahead", interrupted)
        with pytest.raises(KeyboardInterrupt):
            start_copy_ahead(cache, KEY)
    assert len(cache.unclaimed_aheads()) == 1
    _step(groups, 1)
    ahead = start_copy_ahead(cache, KEY)
    assert ahead is not None
    copies, _ = _stage(groups, cache, ahead)
    _assert_equal(copies, groups)


def test_a_stuck_copy_ahead_drops_the_buffers(warm_cache, monkeypatch):
    cache, groups = warm_cache
    ahead = start_copy_ahead(cache, KEY)

    def stuck(running):
        for future, _ in running:  # let the parts end, then report them stuck
            future.result(timeout=30)
        return True, None, StagingCopyTimeoutError("stuck")

    with monkeypatch.context() as patch:
        patch.setattr(copy_pool, "wait_all", stuck)
        with pytest.raises(StagingCopyTimeoutError):
            _stage(groups, cache, ahead)
    assert cache.num_bytes() == 0  # discarded: never lent again
    copies, _ = _stage(groups, cache)
    _assert_equal(copies, groups)


def test_a_failed_part_fails_staging_when_it_was_needed(warm_cache, monkeypatch):
    cache, groups = warm_cache
    ahead = start_copy_ahead(cache, KEY)
    failed = [False]

    def fail_once(self, running):
        if not failed[0]:
            failed[0] = True
            self.settle(running)
            raise RuntimeError("copy failed")
        return original(self, running)

    original = FlatCopy.finish
    with monkeypatch.context() as patch:
        patch.setattr(FlatCopy, "finish", fail_once)
        with pytest.raises(RuntimeError, match="copy failed"):
            _stage(groups, cache, ahead)
    _step(groups, 1)
    ahead = start_copy_ahead(cache, KEY)
    assert ahead is not None  # the buffers went back
    copies, _ = _stage(groups, cache, ahead)
    _assert_equal(copies, groups)


def test_a_copy_ahead_pickles_as_none():
    import pickle

    cache = StagingBufferCache()
    assert pickle.loads(pickle.dumps(copy_ahead.CopyAhead(cache))) is None
