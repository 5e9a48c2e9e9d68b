"""The staging memory budget in one process: the ring plan, staging and writing in rounds
(byte-identical files), the ledger's wait for an earlier save, and the refusals."""

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron_async.errors import CheckpointValidationError, StagingMemoryError, StagingRaceError
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.staging.budget import StagingLedger, resolve_budget, staging_ledger
from megatron_async.staging.rounds import plan_rounds, stage_in_rounds, writer_view
from megatron_async.staging.rounds_control import RoundsControl
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


def test_budget_resolution():
    assert resolve_budget(None, 1234) == 1234  # one copy of the state
    assert resolve_budget(4096, 1234) == 4096
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    try:
        node = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert resolve_budget(0.5, 1) == int(node * 0.5) // 4
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


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


@pytest.mark.timeout(60)
def test_a_tensor_changed_before_its_round_is_copied_fails_the_write(tmp_path):
    tensors = _tensors(count=4, numel=1024)
    buckets = _buckets(tensors)
    control = RoundsControl(len(tensors))
    pool = torch.zeros(8192, dtype=torch.uint8)
    staged = stage_in_rounds(buckets, pool, 8192, control, timeout_s=30.0)
    assert staged.plan.rounds == 2
    tensors[3].add_(1)  # before its round: the writer has not freed the pool yet
    written = []

    staged.start_background_copy()
    (bucket,) = writer_view(control, 30.0, list(staged))
    with pytest.raises(StagingRaceError, match="layer3.weight"):
        for idx, (item, tensor) in enumerate(bucket.data[1]):
            bucket.data[1].before_item(idx)
            written.append(tensor.clone())
            bucket.data[1].after_item(idx)
    control.mark_done()  # as the write path does at its end
    staged.finish_staging()
    assert len(written) == 3 and control.writer_done  # items 0-2; item 3 raced


def test_the_ledger_makes_a_second_save_wait_for_the_first_writer():
    ledger = StagingLedger()
    first = RoundsControl(0)
    ledger.reserve(100, 100, first, timeout_s=5.0)
    with pytest.raises(StagingMemoryError, match=r"needs 60 bytes.*still holds 100 of the 100-byte"):
        ledger.reserve(60, 100, RoundsControl(0), timeout_s=0.2)
    threading.Timer(0.2, first.mark_done).start()
    ledger.reserve(60, 100, RoundsControl(0), timeout_s=30.0)  # returns once the writer is done
    assert ledger.held_bytes() == 60 and ledger.peak_bytes == 100
    ledger.reserve(40, 100, RoundsControl(0), timeout_s=0.0)  # room left: no wait


def test_a_refused_save_leaves_nothing_held(tmp_path):
    tensors = [torch.zeros(4096), torch.zeros(16)]
    held = staging_ledger().held_bytes()
    with pytest.raises(CheckpointException) as raised:  # DCP wraps every rank's error
        _save(str(tmp_path / "refused"), tensors, 8192)
    error = next(iter(raised.value.failures.values()))[0]
    assert isinstance(error, StagingMemoryError)
    assert "tensor 't0' alone needs 16384 bytes" in str(error)
    assert not any(f.endswith(".distcp") for f in os.listdir(tmp_path / "refused"))
    assert staging_ledger().held_bytes() == held


def test_the_callers_release_ends_a_hold_whose_writer_never_marked_done(tmp_path):
    from megatron_async.staging.budget import stage_within_budget

    buckets = _buckets([torch.ones(256)])
    ledger = staging_ledger()
    held = ledger.held_bytes()
    stats = {}
    staged = stage_within_budget(
        RoundsControl(1), buckets, None, None, 5.0, lambda: _StagedList(), False, stats
    )
    assert stats == {"rounds": 1, "peak_bytes": 1024}
    assert ledger.held_bytes() == held + 1024  # no writer ran: still held
    staged.release()  # as a caller does once it killed a hung writer
    assert ledger.held_bytes() == held and staged.released


class _StagedList(list):
    released = False

    def release(self):
        self.released = True


def test_the_info_line_reports_the_staging_peak_and_rounds(caplog):
    import logging

    from megatron_async.core.save_report import SaveDetails, log_finalized_save

    caplog.set_level(logging.INFO, logger="megatron_async")
    details = SaveDetails("ckpt", 0.01, 0.5, 4096, None, staging_bytes=1024, staging_rounds=4)
    log_finalized_save(0, 3, 0.2, 0.1, details)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "staging peak 1024 bytes in 4 round(s)" in line
