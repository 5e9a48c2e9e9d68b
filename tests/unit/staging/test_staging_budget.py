"""The staging memory budget in one process: the ring plan, staging and writing in rounds
(byte-identical files), the ledger's wait for an earlier save, and the refusals."""

import os
import re
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron_async.core.request import run_preload
from megatron_async.errors import (
    CheckpointValidationError,
    StagingHandOverError,
    StagingMemoryError,
    StagingRaceError,
)
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.staging.budget import StagingBufferCache, StagingLedger, resolve_budget
from megatron_async.staging.rounds import plan_bucket_rounds, plan_rounds, stage_in_rounds
from megatron_async.staging.gate import StagingGate
from megatron_async.staging.overlapped import wait_for_staging
from megatron_async.staging.stager import BucketStager, prepare_staged_write
from megatron_async.writer.filesystem import FileSystemWriterAsync
from megatron_async.writer.options import WriteOptions
from tests.unit.staging.test_overlapped_staging import _buckets


def test_the_ring_plan_stays_in_the_budget_and_waits_for_what_it_overwrites():
    sizes = [40, 40, 40, 0, 100, 8]
    plan = plan_rounds(sizes, [f"t{i}" for i in range(len(sizes))], budget=128)
    assert plan.pool_bytes == 104
    for offset, size in zip(plan.offsets, sizes):
        assert offset is None if size == 0 else offset + size <= 128
    assert plan.offsets == [0, 64, 0, None, 0, 0]  # 64-byte aligned; wraps to the start
    assert plan.waits_for == [[], [], [0], [], [2, 1], [4]]
    assert plan.rounds == 4


def test_an_item_in_the_rest_of_a_partly_overwritten_one_waits_for_it():
    plan = plan_rounds([1000, 10, 10], ["big", "a", "b"], budget=1000)
    assert plan.offsets == [0, 0, 64]
    assert plan.waits_for == [[], [0], [0]]  # "b" lands in what is left of "big"


def test_mixed_items_beside_one_budget_sized_tensor_write_the_same_bytes(tmp_path):
    big = torch.arange((1 << 20) // 4, dtype=torch.float32)
    state = {"rows": torch.arange(24.0).reshape(4, 6), "half": torch.arange(6.0).bfloat16(),
             "flags": torch.tensor([True, False, True]), "big": big, "ints": torch.arange(7)}
    for name, limit in (("one", None), ("rounds", big.numel() * 4)):
        writer = FileSystemWriterAsync(
            str(tmp_path / name), options=WriteOptions(thread_count=2, staging_memory_limit=limit)
        )
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.staging_stats["rounds"] >= 2
    files = sorted(f for f in os.listdir(tmp_path / "one") if f.endswith(".distcp"))
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "rounds" / name).read_bytes()


def test_one_copy_plan_is_one_round():
    plan = plan_rounds([64, 64], ["a", "b"], budget=128)
    assert plan.rounds == 1 and plan.waits_for == [[], []]


def test_a_tensor_larger_than_the_budget_is_refused_naming_it_and_the_budget_it_needs():
    with pytest.raises(StagingMemoryError, match=r"'big'.*1000 bytes.*at least 1024"):
        plan_rounds([10, 1000], ["small", "big"], budget=512)


@pytest.mark.parametrize("limit", [0, -5, True, 1.5, "1G", 0.0])
def test_invalid_limits_are_refused_once_with_what_to_pass(limit):
    with pytest.raises(CheckpointValidationError, match="staging_memory_limit must be"):
        TorchDistSaveConfig(staging_memory_limit=limit)


def test_budget_resolution(monkeypatch):
    assert resolve_budget(None, 1234) == 1234  # one copy of the state
    assert resolve_budget(4096, 1234) == 4096
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    node = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert resolve_budget(0.5, 1) == int(node * 0.5) // 4


def test_an_unusable_local_world_size_counts_as_one_rank(monkeypatch):
    node = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for value in ("", "eight"):  # torchrun sets a number; anything else must not fail a save
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
        assert resolve_budget(0.5, 1) == int(node * 0.5)


def _tensors(count=12, numel=4096, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator) for _ in range(count)]


def _save(path, tensors, limit, thread_count=2):
    writer = FileSystemWriterAsync(
        path, options=WriteOptions(thread_count=thread_count, staging_memory_limit=limit)
    )
    dcp.save({f"t{i}": t for i, t in enumerate(tensors)}, storage_writer=writer, no_dist=True)
    return writer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("thread_count", [1, 3])
def test_rounds_write_the_same_bytes_as_one_go(tmp_path, thread_count):
    tensors = _tensors()
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    one_go = _save(str(tmp_path / "one"), tensors, None, thread_count)
    rounds = _save(str(tmp_path / "rounds"), tensors, state_bytes // 4, thread_count)
    assert one_go.staging_stats == {"rounds": 1, "peak_bytes": state_bytes}
    assert rounds.staging_stats["rounds"] >= 4
    assert rounds.staging_stats["peak_bytes"] <= state_bytes // 4
    files = sorted(f for f in os.listdir(tmp_path / "one") if f.endswith(".distcp"))
    assert files and files == sorted(f for f in os.listdir(tmp_path / "rounds") if f.endswith(".distcp"))
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "rounds" / name).read_bytes()
    loaded = {f"t{i}": torch.zeros_like(t) for i, t in enumerate(tensors)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "rounds"), no_dist=True)
    for i, tensor in enumerate(tensors):
        assert torch.equal(loaded[f"t{i}"], tensor)


def _drain_in_thread(gate, staged, copies_done_before=None):
    """The background writer: read every item as the rounds arrive, then mark done.

    With ``copies_done_before``, the writer first waits at that item until this process's
    copy job is done (:func:`~megatron_async.staging.overlapped.wait_for_staging`), so the
    copy thread's verdict on the later rounds (each item copied, or a failure recorded)
    is in before the writer looks. Without it, a writer that finds an item not copied yet
    may see, at its next look, the failure recorded for a later item right after that
    one was copied, and stop there (a recorded failure ends every wait at once): how many
    items a failed save wrote would depend on how the threads interleave.
    """
    written, errors = [], []

    def drain():
        (bucket,) = gate.writer_view(list(staged), 60.0)
        try:
            for idx, (_, tensor) in enumerate(bucket.data[1]):
                if idx == copies_done_before:
                    wait_for_staging(timeout_s=60)
                bucket.data[1].before_item(idx)
                written.append(tensor.clone())
                bucket.data[1].after_item(idx)
        except BaseException as exc:
            errors.append(exc)
        finally:
            gate.mark_done()

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return thread, written, errors


@pytest.mark.timeout(60)
def test_a_tensor_changed_before_its_round_is_copied_fails_the_write(tmp_path):
    tensors = _tensors(count=4, numel=1024)
    buckets = _buckets(tensors)
    gate = StagingGate(len(tensors))
    pool = torch.zeros(8192, dtype=torch.uint8)
    plan = plan_bucket_rounds(buckets, 8192)
    staged = stage_in_rounds(buckets, pool, plan, gate, timeout_s=30.0)
    assert plan.rounds == 2 and plan.waits_for == [[], [], [0], [1]]
    tensors[3].add_(1)  # before its round: the writer has not freed the pool yet

    staged.hand_over(os.getpid(), finish=False)
    # the second round (items 2, 3) is copied once the writer freed the first
    thread, written, errors = _drain_in_thread(gate, staged, copies_done_before=2)
    thread.join(60)
    staged.finish_staging()
    (error,) = errors
    assert isinstance(error, StagingRaceError) and "layer3.weight" in str(error)
    assert len(written) == 3 and gate.writer_done  # items 0-2; item 3 raced
    assert all(torch.equal(w, t) for w, t in zip(written, tensors))


def test_the_ledger_makes_a_second_save_wait_for_the_first_writer():
    from megatron_async.staging.overlapped import StagedData

    ledger = StagingLedger()

    def stage(num_bytes, gate, timeout_s):
        return ledger.stage_within(lambda pool: StagedData(), state_bytes=num_bytes, budget=100,
                                   in_rounds=False, gate=gate, pinned=False, timeout_s=timeout_s)

    first = StagingGate(0)
    stage(100, first, timeout_s=5.0)
    with pytest.raises(StagingMemoryError, match=r"needs 60 bytes.*still holds 100 of the 100-byte"):
        stage(60, StagingGate(0), timeout_s=0.2)
    threading.Timer(0.2, first.mark_done).start()
    stage(60, StagingGate(0), timeout_s=30.0)  # returns once the writer is done
    assert ledger.held_bytes() == 60 and ledger.peak_bytes == 100
    stage(40, StagingGate(0), timeout_s=0.0)  # room left: no wait


def test_a_refused_save_leaves_nothing_held(tmp_path):
    tensors = [torch.zeros(4096), torch.zeros(16)]
    held = StagingLedger.of_process().held_bytes()
    with pytest.raises(CheckpointException) as raised:  # DCP wraps every rank's error
        _save(str(tmp_path / "refused"), tensors, 8192)
    error = next(iter(raised.value.failures.values()))[0]
    assert isinstance(error, StagingMemoryError)
    assert "tensor 't0' alone needs 16384 bytes" in str(error)
    assert not any(f.endswith(".distcp") for f in os.listdir(tmp_path / "refused"))
    assert StagingLedger.of_process().held_bytes() == held


def test_rounds_outside_our_callers_are_refused_before_anything_is_held():
    buckets = _buckets([torch.ones(1024), torch.ones(1024)])  # 8 KiB, budget 4 KiB
    held = StagingLedger.of_process().held_bytes()
    with pytest.raises(StagingHandOverError, match="at least 8192 bytes"):
        BucketStager(StagingGate(2), buckets, limit=4096, stage_one_go=list, timeout_s=5.0).stage()
    assert StagingLedger.of_process().held_bytes() == held
    stats = {}
    gate = StagingGate(2)
    staged = BucketStager(gate, buckets, limit=8192, stage_one_go=_StagedList,
                          stats=stats, timeout_s=5.0).stage()
    assert stats["rounds"] == 1  # within the budget any caller may stage
    del staged  # an override's staged data, dropped: held until its writer is done
    assert StagingLedger.of_process().held_bytes() == held + 8192
    gate.mark_done()
    assert StagingLedger.of_process().held_bytes() == held


def test_the_callers_release_ends_a_hold_whose_writer_never_marked_done(tmp_path):
    buckets = _buckets([torch.ones(256)])
    ledger = StagingLedger.of_process()
    held = ledger.held_bytes()
    stats = {}
    staged = BucketStager(StagingGate(1), buckets, cache=StagingBufferCache(), stats=stats,
                          timeout_s=5.0).stage()
    assert stats == {"rounds": 1, "peak_bytes": 1024}
    assert ledger.held_bytes() == held + 1024  # no writer ran: still held
    staged.release()  # as a caller does once it killed a hung writer
    assert ledger.held_bytes() == held and staged.loan.released


def _read_after_release(release_path, staged, gate):
    """A forked writer that reads the staged buckets once ``release_path`` exists, then
    marks the save's gate done as our write path does."""
    while not os.path.exists(release_path):
        time.sleep(0.01)
    sum(float(tensor.sum()) for bucket in staged for _, tensor in bucket.data[1])
    gate.mark_done()


@pytest.mark.timeout(120)
def test_megatron_core_016_queue_dropping_the_staged_data_while_its_writer_reads_keeps_it_counted(
        tmp_path, monkeypatch):
    """megatron-core 0.16's TemporalAsyncCaller keeps no reference to the staged data once
    it forked its writer, which still reads it: the next save's staging still counts the
    first save's bytes and waits (within its bound) until that writer is done."""
    import gc

    from megatron.core.dist_checkpointing.strategies import async_utils as mcore

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args, **kwargs: 0)
    ledger = StagingLedger()
    monkeypatch.setattr(StagingLedger, "of_process", classmethod(lambda cls: ledger))
    tensors = [torch.ones(256)]  # 1024 bytes; the budget is one copy of the state
    gate = StagingGate(1)
    first = BucketStager(gate, _buckets(tensors), cache=StagingBufferCache(), cache_key="k",
                         timeout_s=5.0)
    release = tmp_path / "release"
    caller = mcore.TemporalAsyncCaller()
    caller.schedule_async_call(mcore.AsyncRequest(
        _read_after_release, (str(release), None, gate), [], preload_fn=first.stage))
    try:
        caller.__dict__.pop("preloaded_holder", None)  # later generations keep it; 0.16 does not
        gc.collect()
        assert ledger.held_bytes() == 1024  # its writer still reads the staged data
        with pytest.raises(StagingMemoryError, match="still holds 1024 of the 1024-byte"):
            BucketStager(StagingGate(1), _buckets(tensors), timeout_s=0.3).stage()
    finally:
        release.write_text("done")
        assert caller.is_current_async_call_done(blocking=True, no_dist=True)
    assert gate.writer_done and ledger.held_bytes() == 0
    second = BucketStager(StagingGate(1), _buckets(tensors), timeout_s=5.0).stage()
    assert ledger.held_bytes() == 1024
    second.release()
    assert ledger.held_bytes() == 0


class _StagedList(list):
    released = False

    def release(self):
        self.released = True


def test_staging_binds_its_gate_and_cache_only_where_they_are_taken():
    """The writer's one entry into staging: the write path gets the save's gate if it takes
    ``staging_control``; overrides with the reference signature run without it (and then
    refuse rounds and overlapped staging), and a reference ``preload_tensors`` stages
    without the cache."""
    buckets = _buckets([torch.ones(256), torch.ones(4)])  # 1040 bytes
    plan_data = ("/nonexistent", (None, buckets))
    preloaded, written = [], []

    def ours(transforms, rank, staged, queue, *, use_fsync=True, staging_control=None):
        pass

    def reference(transforms, rank, staged, queue, *, use_fsync=True):
        written.append({"use_fsync": use_fsync})

    def preload_reference(resolved_plan_data, non_blocking=True):
        preloaded.append((resolved_plan_data, non_blocking))
        return _StagedList()

    def prepare(write_path, limit=None, overlapped=False):
        return prepare_staged_write(
            write_path, ("transforms",), {"use_fsync": False}, preload_tensors=preload_reference,
            resolved_plan_data=plan_data, overlapped=overlapped, limit=limit, cache=None,
            stats={},
        )

    save_fn, _ = prepare(ours)
    assert save_fn.args == ("transforms",) and save_fn.keywords["use_fsync"] is False
    assert isinstance(save_fn.keywords["staging_control"], StagingGate)
    save_fn, preload_fn = prepare(reference, limit=1024)
    save_fn(0, None, None)  # the reference write path runs without the gate, which is then done
    assert written == [{"use_fsync": False}] and save_fn.args[0].writer_done
    with pytest.raises(StagingMemoryError, match="cannot take items in rounds"):
        preload_fn()
    _, preload_fn = prepare(reference, overlapped=True)
    with pytest.raises(StagingMemoryError, match="overlap_staging"):
        run_preload(preload_fn)
    assert preloaded == []
    save_fn, preload_fn = prepare(reference)
    save_fn("rank", preload_fn(), "queue")  # marks the gate done: the staged data is not ours
    assert preloaded == [(plan_data, True)]
    # Our write path, but each bucket written by a subclass's write_preloaded_data, which
    # may read items before they are copied: rounds and overlapped staging are refused.
    refusals = ((1024, False, "cannot take items in rounds"), (None, True, "overlap_staging"))
    for limit, overlapped, refusal in refusals:
        _, preload_fn = prepare_staged_write(
            ours, ("transforms",), {}, preload_tensors=preload_reference,
            resolved_plan_data=plan_data, overlapped=overlapped, limit=limit, cache=None,
            stats={}, own_bucket_writer=False,
        )
        with pytest.raises(StagingMemoryError, match=refusal):
            run_preload(preload_fn)


def test_the_info_line_reports_the_staging_peak_and_rounds(caplog):
    import logging

    from megatron_async.core.queue import log_finalized_save
    from megatron_async.core.request import SaveDetails

    caplog.set_level(logging.INFO, logger="megatron_async")
    details = SaveDetails("ckpt", 4096, 1024, 4, plan_s=0.01, write_s=0.5)
    log_finalized_save(3, 0.2, 0.1, details)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "staging peak 1024 bytes in 4 round(s)" in line


# -- overlapped staging above the budget: every round copied by the copy thread ------------


def _overlapped_rounds(tensors, pool_bytes, stats=None):
    gate = StagingGate(len(tensors))
    stager = BucketStager(gate, _buckets(tensors), limit=pool_bytes, overlapped=True,
                          stats={} if stats is None else stats, timeout_s=60.0)
    return run_preload(stager.stage), gate


@pytest.mark.timeout(120)
def test_overlapped_rounds_write_the_same_bytes_as_one_go(tmp_path):
    tensors = _tensors()
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    state = {f"t{i}": t for i, t in enumerate(tensors)}
    for name, limit in (("one", None), ("overlapped", state_bytes // 4)):
        writer = FileSystemWriterAsync(str(tmp_path / name), options=WriteOptions(
            thread_count=2, staging_memory_limit=limit, overlap_staging=True))
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.staging_stats["rounds"] >= 4
    assert writer.staging_stats["peak_bytes"] <= state_bytes // 4
    files = sorted(f for f in os.listdir(tmp_path / "one") if f.endswith(".distcp"))
    assert files
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "overlapped" / name).read_bytes()
    loaded = {key: torch.zeros_like(t) for key, t in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "overlapped"), no_dist=True)
    assert all(torch.equal(loaded[key], t) for key, t in state.items())


@pytest.mark.timeout(60)
def test_overlapped_rounds_copy_nothing_while_scheduling_and_the_step_waits_for_the_last():
    from tests.staging_aids import copies_held, staging_in_progress

    params = [torch.nn.Parameter(torch.full((1024,), float(i))) for i in range(4)]
    optimizer = torch.optim.SGD(params, lr=1.0)
    for param in params:
        param.grad = torch.ones(1024)
    stats = {}
    staged, gate = _overlapped_rounds([p.detach() for p in params], 8192, stats)
    assert stats["rounds"] == 2
    assert not any(gate.is_staged(i) for i in range(4))  # scheduling copied nothing
    with copies_held():
        staged.hand_over(os.getpid(), finish=False)
        assert staging_in_progress()
    thread, written, errors = _drain_in_thread(gate, staged)
    optimizer.step()  # the step pre-hook waits until the last round is copied
    assert all(gate.is_staged(i) for i in range(4)) and not gate.failed
    thread.join(60)
    assert not errors and len(written) == 4
    for i, (param, value) in enumerate(zip(params, written)):
        assert torch.equal(value, torch.full((1024,), float(i)))  # the state at scheduling
        assert torch.equal(param.detach(), torch.full((1024,), float(i) - 1.0))  # stepped


@pytest.mark.timeout(60)
def test_overlapped_rounds_a_tensor_changed_before_its_copy_fails_the_write_naming_it(monkeypatch):
    from megatron_async.core import coordination
    from tests.staging_aids import copies_held

    monkeypatch.setattr(coordination, "get_rank", lambda: 3)
    tensors = _tensors(count=4, numel=1024)
    stats = {}
    staged, gate = _overlapped_rounds(tensors, 8192, stats)
    assert stats["rounds"] == 2
    with copies_held():
        staged.hand_over(os.getpid(), finish=False)
        tensors[3].add_(1)  # no optimizer step, no wait: an unguarded in-place update
    # the second round (items 2, 3) is copied once the writer freed the first
    thread, written, errors = _drain_in_thread(gate, staged, copies_done_before=2)
    wait_for_staging(timeout_s=60)
    thread.join(60)
    (error,) = errors
    assert isinstance(error, StagingRaceError)
    assert re.search(r"rank 3: saved tensor 'layer3.weight'.*wait_for_staging\(\)", str(error))
    assert len(written) == 3  # the items before it, as they were at scheduling
    assert all(torch.equal(w, t) for w, t in zip(written, tensors))


@pytest.mark.timeout(120)
def test_overlapped_rounds_end_when_the_writer_process_is_gone():
    import multiprocessing

    tensors = _tensors(count=4, numel=1024)
    staged, gate = _overlapped_rounds(tensors, 8192)
    # A writer that started reading (recorded its pid) and died without marking anything:
    # left unreaped, it is a zombie, which counts as gone.
    writer = multiprocessing.get_context("fork").Process(target=gate.record_writer)
    writer.start()
    # The trainer hands over naming the writer's pid, as the callers do; whichever of the
    # two records it first, the gate watches the writer (naming the trainer raced with it).
    staged.hand_over(writer.pid, finish=False)
    wait_for_staging(timeout_s=60)  # returns at the liveness check, not at the 60 s bound
    writer.join(10)
    assert gate.failed and "background writer of this save ended" in gate.message()
    assert [gate.is_staged(i) for i in range(4)] == [True, True, False, False]


# -- the gate under failures: no wait outlives a failed or dead writer ------------


def _rounds(count=4, numel=1024, pool_bytes=8192, timeout_s=30.0):
    tensors = _tensors(count=count, numel=numel)
    gate = StagingGate(len(tensors))
    pool = torch.zeros(pool_bytes, dtype=torch.uint8)
    buckets = _buckets(tensors)
    plan = plan_bucket_rounds(buckets, pool_bytes)
    staged = stage_in_rounds(buckets, pool, plan, gate, timeout_s=timeout_s)
    return tensors, gate, staged, plan


@pytest.mark.timeout(60)
def test_a_failed_bucket_stops_the_trainer_copy_and_the_other_buckets_at_once():
    from megatron_async.errors import StorageWriteError

    _, gate, staged, _ = _rounds(timeout_s=30.0)
    start = time.monotonic()
    staged.hand_over(os.getpid(), finish=False)  # waits for items 0 and 1 to be written
    (bucket,) = gate.writer_view(list(staged), 30.0)
    bucket.data[1].abandon(OSError(28, "No space left on device"))  # bucket 0 failed
    staged.finish_staging()
    with pytest.raises(StorageWriteError, match="No space left on device"):
        bucket.data[1].before_item(3)  # another bucket waiting for a later round
    assert time.monotonic() - start < 10.0  # not the 30 s bound
    assert gate.failed_by_writer and not gate.is_staged(3)


def test_done_comes_first_and_a_late_copy_does_not_undo_written():
    from megatron_async.staging.gate import wait_for_room

    gate = StagingGate(3)
    gate.mark_copied(0)
    gate.mark_done()
    gate.mark_copied(1)  # a trainer copy that finished after the writer stopped
    assert gate.writer_done and all(gate.is_written(i) for i in range(3))
    assert wait_for_room(gate, [0, 1, 2], 1.0, "unused") is False  # nothing more to copy


@pytest.mark.timeout(60)
def test_each_wait_for_the_writer_is_bounded_on_its_own_not_the_whole_save():
    tensors, gate, staged, plan = _rounds(count=6, numel=1024, pool_bytes=8192, timeout_s=0.6)
    assert plan.rounds == 3
    staged.hand_over(os.getpid(), finish=False)
    (bucket,) = gate.writer_view(list(staged), 30.0)
    written = []
    for idx, (_, tensor) in enumerate(bucket.data[1]):  # a slow writer: 0.25 s an item
        bucket.data[1].before_item(idx)
        time.sleep(0.25)
        written.append(tensor.clone())
        bucket.data[1].after_item(idx)
    gate.mark_done()
    staged.finish_staging()
    assert not gate.failed, gate.message()  # 1.5 s in all, each wait below 0.6 s
    assert all(torch.equal(w, t) for w, t in zip(written, tensors))


@pytest.mark.timeout(60)
def test_a_writer_that_dies_before_reading_ends_the_copy_and_the_hold():
    import multiprocessing

    from megatron_async.core.request import hand_over_staged

    tensors = _tensors(count=4, numel=1024)
    gate = StagingGate(len(tensors))
    held = StagingLedger.of_process().held_bytes()
    staged = run_preload(BucketStager(gate, _buckets(tensors), limit=8192, timeout_s=30.0).stage)
    writer = multiprocessing.get_context("fork").Process(target=lambda: None)  # dies at once
    writer.start()
    writer.join(10)
    start = time.monotonic()
    hand_over_staged(staged, writer.pid)  # as the callers do
    assert time.monotonic() - start < 10.0
    assert gate.failed and "ended before it freed the staging memory" in gate.message()
    assert StagingLedger.of_process().held_bytes() == held  # the hold ended with its writer


@pytest.mark.timeout(60)
def test_the_pool_is_reused_only_after_the_earlier_copy_job_ended():
    from megatron_async.staging.overlapped import CopyJob, CopyThread, watch
    from tests.staging_aids import copies_held

    ledger, copy_thread = StagingLedger.of_process(), CopyThread.of_process()
    source, buffer = torch.ones(16), torch.zeros(16)
    with copies_held():  # an earlier save's copy that has not run yet
        copy_thread.submit(CopyJob(StagingGate(1), [("t", source, buffer, watch(source))], [0], [()]))
        with pytest.raises(StagingMemoryError, match="earlier save's copy into the staging pool"):
            ledger.pool(4096, pinned=False, timeout_s=0.1)
    wait_for_staging(timeout_s=30.0)
    assert torch.equal(buffer, source)
    assert ledger.pool(4096, pinned=False, timeout_s=0.1).numel() == 4096
    ledger.drop_pool()


@pytest.mark.timeout(60)
def test_a_live_overlapped_rounds_save_does_not_block_the_next_pool_lease():
    tensors = _tensors(count=4, numel=1024)
    gate = StagingGate(len(tensors))
    staged = run_preload(BucketStager(gate, _buckets(tensors), limit=8192, overlapped=True,
                                      timeout_s=30.0).stage)
    gate.mark_done()  # its writer is done; the staged data is still referenced here
    staged.hand_over(os.getpid(), finish=False)
    wait_for_staging(timeout_s=30.0)
    assert StagingLedger.of_process().pool(8192, pinned=False, timeout_s=1.0).numel() == 8192
    staged.release()
