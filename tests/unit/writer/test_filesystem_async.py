"""FileSystemWriterAsync in one process (no torch.distributed): buckets, staging, writing, errors."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import re
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_async.staging.budget import StagingBufferCache
from megatron_async.core import shared_memory
from megatron_async.buckets.layout import assign_buckets, balance_by_size, item_num_bytes
from megatron_async.errors import (
    CheckpointIntegrityError,
    CheckpointValidationError,
    StorageWriteError,
    WorkerDiedError,
)
from megatron_async.writer.options import WriteOptions
from megatron_async.writer.filesystem import FileSystemWriterAsync
from tests.staging_aids import forget_staging_buffers

pytestmark = pytest.mark.timeout(120)


def _prepare(writer: FileSystemWriterAsync, state_dict):
    """Plan like a single-rank save and prepare the writer; return the global metadata."""
    planner = DefaultSavePlanner(flatten_state_dict=False)
    planner.set_up_planner(state_dict, is_coordinator=True)
    writer.set_up_storage_writer(True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    _, metadata = planner.create_global_plan([local_plan])
    plan = planner.finish_plan(writer.prepare_decentralized_global_plan(local_plan))
    writer.prepare_write_data(plan, planner)
    return metadata


def _run(writer: FileSystemWriterAsync) -> None:
    """Stage and write the way a caller does: preload result replaces args[1]."""
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    staged_args = list(args)
    staged_args[1] = preload_fn()
    save_fn(*staged_args)


def _save(tmp_path, state_dict, **writer_kwargs) -> FileSystemWriterAsync:
    writer = FileSystemWriterAsync(str(tmp_path), **writer_kwargs)
    metadata = _prepare(writer, state_dict)
    _run(writer)
    writer.finish(metadata, [writer.retrieve_write_results()])
    return writer


def _load(tmp_path, template):
    out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in template.items()}
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    return out


def _tensor_item(fqn: str, numel: int, dtype=torch.float32) -> WriteItem:
    planner = DefaultSavePlanner(flatten_state_dict=False)
    planner.set_up_planner({fqn: torch.zeros(numel, dtype=dtype)}, is_coordinator=True)
    return planner.create_local_plan().items[0]


def _bytes_item(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


# -- bucket planning -------------------------------------------------------------------


def test_balance_by_size_keeps_bins_even_and_deterministic():
    sized = [(name, size) for name, size in zip("abcdefg", [70, 50, 40, 30, 20, 10, 10])]
    bins = balance_by_size(sized, 3)
    sums = sorted(sum(dict(sized)[n] for n in b) for b in bins)
    assert sums == [70, 80, 80]  # total 230: as even as whole items allow
    assert balance_by_size(sized, 3) == bins


def test_item_size_uses_chunk_and_dtype_and_bytes_length():
    assert item_num_bytes(_tensor_item("t", 10, torch.bfloat16)) == 20
    assert item_num_bytes(_tensor_item("t", 3, torch.int64)) == 24
    assert item_num_bytes(_bytes_item("b"), io.BytesIO(b"x" * 33)) == 33


def test_assign_buckets_balances_tensors_and_bytes_by_size():
    resolved = [(_tensor_item(f"t{i}", n), None) for i, n in enumerate([400, 100, 100, 100, 100])]
    resolved.append((_bytes_item("blob"), io.BytesIO(b"x" * 1600)))
    layout = assign_buckets(resolved, thread_count=2)
    assert len(layout) == 2
    loads = sorted(sum(item_num_bytes(*resolved[p]) for p in positions) for _, positions in layout)
    assert loads == [2400, 2400]  # 4800 bytes: blob + two small tensors | big + two small


def test_separation_hint_gets_its_own_files(tmp_path):
    state_dict = {
        "optimizer.m": torch.ones(4),
        "optimizer.v": torch.ones(4) * 2,
        "model.w": torch.ones(8) * 3,
    }
    writer = _save(tmp_path, state_dict, thread_count=1, separation_hint="optimizer.")
    names = sorted(b.file_name for b in writer.write_buckets)
    assert names == ["__0_0.distcp", "optimizer.__0_1.distcp"]
    for bucket in writer.write_buckets:
        fqns = {item.index.fqn for item, _ in bucket.data[1]}
        assert all(f.startswith("optimizer.") for f in fqns) == bucket.file_name.startswith("optim")
    out = _load(tmp_path, state_dict)
    assert all(torch.equal(out[k], v) for k, v in state_dict.items())


def test_file_names_follow_the_dcp_storage_prefix(tmp_path):
    state_dict = {f"t{i}": torch.full((16,), float(i)) for i in range(6)}
    writer = _save(tmp_path, state_dict, thread_count=3)
    assert sorted(os.listdir(tmp_path)) == [
        ".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "megatron_async_checksums_rank0.json"
    ]
    assert len(writer.write_buckets) == 3


def test_bad_options_raise_validation_errors(tmp_path):
    with pytest.raises(CheckpointValidationError, match="separation_hint"):
        FileSystemWriterAsync(str(tmp_path), separation_hint="a/b")
    with pytest.raises(CheckpointValidationError, match="thread_count"):
        FileSystemWriterAsync(str(tmp_path), thread_count=0)


# -- round trip and dtypes -------------------------------------------------------------


def test_round_trip_of_dtypes_views_and_empty_tensors(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state_dict = {
        "fp32": base.clone(),
        "bf16": base.to(torch.bfloat16),
        "fp16": base.to(torch.float16),
        "int64": torch.arange(7, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "view": base.t()[1:3],  # non-contiguous
        "empty": torch.zeros(0, 5),
    }
    _save(tmp_path, state_dict, thread_count=3)
    out = _load(tmp_path, state_dict)
    for key, value in state_dict.items():
        assert out[key].dtype == value.dtype and torch.equal(out[key], value), key


def test_dcp_save_can_use_the_writer_synchronously(tmp_path):
    state_dict = {"a": torch.arange(5.0), "nested": {"b": torch.ones(2, 2)}}
    dcp.save(state_dict, storage_writer=FileSystemWriterAsync(str(tmp_path), thread_count=2), no_dist=True)
    out = {"a": torch.zeros(5), "nested": {"b": torch.zeros(2, 2)}}
    dcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(out["a"], state_dict["a"]) and torch.equal(out["nested"]["b"], torch.ones(2, 2))


def test_functions_pickle_for_the_persistent_worker(tmp_path):
    writer = FileSystemWriterAsync(str(tmp_path), thread_count=2)
    _prepare(writer, {"a": torch.ones(3)})
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    assert len(args) == 3 and args[1] is None
    restored_save, restored_preload, restored_args = pickle.loads(
        pickle.dumps((save_fn, preload_fn, args))
    )
    restored_save(restored_args[0], restored_preload(), restored_args[2])
    assert len(writer.retrieve_write_results()) == 1


def test_nothing_to_write_returns_no_functions(tmp_path):
    writer = FileSystemWriterAsync(str(tmp_path))
    _prepare(writer, {})
    assert writer.get_save_function_and_args() == (None, None, None)
    assert writer.retrieve_write_results() == []


# -- staging ---------------------------------------------------------------------------


def test_cpu_to_cpu_is_not_a_copy_so_staging_must_clone():
    tensor = torch.ones(4)
    assert tensor.to("cpu") is tensor  # the trap a naive "stage to host" falls into


def test_staged_data_is_a_snapshot_of_cpu_tensors(tmp_path):
    state_dict = {"w": torch.ones(8), "view": torch.ones(4, 4).t(), "empty": torch.zeros(0)}
    writer = FileSystemWriterAsync(str(tmp_path), thread_count=2)
    metadata = _prepare(writer, state_dict)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    staged = preload_fn()
    for tensor in state_dict.values():
        tensor.add_(41)  # the trainer's next step updates tensors in place
    save_fn(args[0], staged, args[2])
    writer.finish(metadata, [writer.retrieve_write_results()])
    out = _load(tmp_path, state_dict)
    assert torch.equal(out["w"], torch.ones(8))
    assert torch.equal(out["view"], torch.ones(4, 4))
    for bucket in staged:
        for item, tensor in bucket.data[1]:
            assert tensor.is_contiguous()
            if tensor.numel():
                assert tensor.data_ptr() != state_dict[item.index.fqn].data_ptr()


def test_cached_data_structure_reuses_buffers_without_growth(tmp_path):
    forget_staging_buffers()
    state_dict = {"a": torch.ones(256), "b": torch.ones(64, dtype=torch.bfloat16)}
    checkpoint_bytes = 256 * 4 + 64 * 2
    pointers = []
    for step in range(3):
        for tensor in state_dict.values():
            tensor.fill_(step)
        target = tmp_path / f"step{step}"
        target.mkdir()
        writer = FileSystemWriterAsync(str(target), thread_count=2, use_cached_data_structure=True)
        metadata = _prepare(writer, state_dict)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        staged = preload_fn()
        pointers.append(sorted(t.data_ptr() for b in staged for _, t in b.data[1]))
        save_fn(args[0], staged, args[2])
        staged.release()  # what the caller does once the call is over
        writer.finish(metadata, [writer.retrieve_write_results()])
        assert StagingBufferCache.of_process().num_bytes() == checkpoint_bytes
        out = _load(target, state_dict)
        assert torch.equal(out["a"], torch.full((256,), float(step)))
    assert pointers[0] == pointers[1] == pointers[2]
    forget_staging_buffers()


def test_cached_buffers_still_to_be_written_are_never_restaged(tmp_path):
    forget_staging_buffers()
    state_dict = {"a": torch.zeros(32)}
    writers, staged = [], []
    for step in range(2):
        target = tmp_path / f"s{step}"
        target.mkdir()
        # A budget of two copies: the default (one) would make the second staging wait
        # for the first save's writer instead (tests/unit/staging/test_staging_budget.py).
        options = WriteOptions(use_cached_data_structure=True, staging_memory_limit=2 * 32 * 4)
        writer = FileSystemWriterAsync(str(target), options=options)
        _prepare(writer, state_dict)
        staged.append(writer.get_save_function_and_args()[1]())
        writers.append(writer)
        state_dict["a"].fill_(1.0)
    # The first staging is not written yet (a pipelined caller): the second got new buffers.
    assert torch.equal(staged[0][0].data[1][0][1], torch.zeros(32))
    assert torch.equal(staged[1][0].data[1][0][1], torch.ones(32))
    for each in staged:
        each.release()
    forget_staging_buffers()


def _exit_with_first_value(tensor):
    os._exit(int(tensor[0].item()))


def test_staging_buffers_are_shared_memory_leased_until_released(tmp_path):
    """A forked writer reads the staged snapshot; the buffers are reused only after release."""
    forget_staging_buffers()
    state_dict = {"a": torch.zeros(32)}
    pointers = []
    for step in range(2):
        state_dict["a"].fill_(step + 3)
        target = tmp_path / f"s{step}"
        target.mkdir()
        writer = FileSystemWriterAsync(str(target), use_cached_data_structure=True)
        _prepare(writer, state_dict)
        staged = writer.get_save_function_and_args()[1]()
        buffer = staged[0].data[1][0][1]
        assert shared_memory.find_segment(buffer) is not None
        pointers.append(buffer.data_ptr())
        # What the temporal caller does: fork, let the child read the snapshot.
        child = mp.get_context("fork").Process(target=_exit_with_first_value, args=(buffer,))
        child.start()
        child.join(30)
        assert child.exitcode == step + 3
        staged.release()
    assert pointers[0] == pointers[1]
    forget_staging_buffers()


# -- results and errors ----------------------------------------------------------------


class _FailingWriter(FileSystemWriterAsync):
    """Fails every bucket whose file name ends in ``_1.distcp``."""

    @staticmethod
    def write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs):
        if bucket.file_name.endswith("_1.distcp"):
            raise OSError(28, "No space left on device (injected)")
        return FileSystemWriterAsync.write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs)


class _ShortWriter(FileSystemWriterAsync):
    """Reports one result too few for every bucket."""

    @staticmethod
    def write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs):
        index, results = FileSystemWriterAsync.write_preloaded_data(
            transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs
        )
        return index, results[:-1]


_TWO_BUCKETS = {"a": torch.ones(16), "b": torch.ones(16)}


def _wrapped_failure(writer):
    """The wrapped exception retrieve_write_results returns for a failed write."""
    outcome = writer.retrieve_write_results()
    assert isinstance(outcome, tuple) and len(outcome) == 2, outcome
    exc, stack = outcome
    assert isinstance(exc, BaseException) and isinstance(stack, traceback.StackSummary)
    return exc


def test_a_failed_bucket_returns_storage_write_error_with_traceback(tmp_path):
    writer = _FailingWriter(str(tmp_path), thread_count=2)
    _prepare(writer, _TWO_BUCKETS)
    _run(writer)
    exc = _wrapped_failure(writer)
    assert isinstance(exc, StorageWriteError)
    assert re.match("^Worker failure on rank 0: .*No space left", str(exc)), str(exc)
    assert "injected" in exc.failure.traceback_text
    # The original exception object travels with it, of its own type.
    original = exc.failure.exception()
    assert isinstance(original, OSError) and original.errno == 28


def test_too_few_results_return_integrity_error(tmp_path):
    writer = _ShortWriter(str(tmp_path), thread_count=2)
    _prepare(writer, _TWO_BUCKETS)
    _run(writer)
    exc = _wrapped_failure(writer)
    assert isinstance(exc, CheckpointIntegrityError)
    assert "of 1 written items" in str(exc)
    assert "This probably indicates a worker failure." in str(exc)


def test_no_result_from_the_writer_returns_worker_died(tmp_path):
    writer = FileSystemWriterAsync(str(tmp_path), thread_count=2)
    _prepare(writer, _TWO_BUCKETS)  # the background part never runs (killed worker)
    exc = _wrapped_failure(writer)
    assert isinstance(exc, WorkerDiedError)
    assert re.match("^Worker failure on rank 0: .*reported no result", str(exc)), str(exc)


def test_save_function_without_staging_fails_clearly(tmp_path):
    writer = FileSystemWriterAsync(str(tmp_path))
    _prepare(writer, _TWO_BUCKETS)
    save_fn, _, args = writer.get_save_function_and_args()
    save_fn(*args)  # args[1] is still the None placeholder
    exc = _wrapped_failure(writer)
    assert isinstance(exc, StorageWriteError) and "preload_fn" in str(exc)


# -- finish ----------------------------------------------------------------------------


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle (injected)")


def test_finish_is_atomic_and_leaves_the_cached_metadata_alone(tmp_path):
    state_dict = {"a": torch.ones(3)}
    writer = FileSystemWriterAsync(str(tmp_path))
    metadata = _prepare(writer, state_dict)
    _run(writer)
    results = writer.retrieve_write_results()
    writer.finish(metadata, [results])
    assert metadata.storage_data is None  # the caller's (possibly cached) object is untouched
    before = (tmp_path / ".metadata").read_bytes()

    metadata.planner_data = _Unpicklable()
    with pytest.raises(RuntimeError, match="injected"):
        writer.finish(metadata, [results])
    assert (tmp_path / ".metadata").read_bytes() == before  # the old file survives intact
    assert torch.equal(_load(tmp_path, state_dict)["a"], torch.ones(3))


def test_staging_cpu_tensors_never_touches_cuda(tmp_path, monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA API was called while staging CPU tensors")

    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    _save(tmp_path, {"a": torch.ones(4)}, thread_count=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_staged_to_pinned_host_memory(tmp_path):
    state_dict = {"a": torch.arange(8.0, device="cuda"), "b": torch.ones(3, 3, device="cuda").t()}
    writer = FileSystemWriterAsync(str(tmp_path), thread_count=2)
    metadata = _prepare(writer, state_dict)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    staged = preload_fn()
    for tensor in state_dict.values():
        tensor.add_(1)
    for bucket in staged:
        for _, tensor in bucket.data[1]:
            assert tensor.device.type == "cpu" and tensor.is_pinned()
    save_fn(args[0], staged, args[2])
    writer.finish(metadata, [writer.retrieve_write_results()])
    out = _load(tmp_path, {k: v.cpu() for k, v in state_dict.items()})
    assert torch.equal(out["a"], torch.arange(8.0)) and torch.equal(out["b"], torch.ones(3, 3))


def test_a_save_that_used_fresh_buffers_never_frees_a_later_save_s_buffers():
    """Pipelined saves in one process (the persistent worker): write n overlaps staging n+1."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from megatron_async.staging.buffers import stage_buckets
    from megatron_async.buckets.layout import WriteBucket

    source = torch.zeros(4)
    item = WriteItem(index=MetadataIndex("t"), type=WriteItemType.TENSOR)
    buckets = [WriteBucket("/unused", "unused", ([], [(item, source)]))]
    key = "pipelined-layout"
    forget_staging_buffers()
    try:
        source.fill_(1)
        save1 = stage_buckets(buckets, True, key)  # into the cached buffers
        source.fill_(2)
        save2 = stage_buckets(buckets, True, key)  # cached buffers busy: fresh ones
        save1.release()  # save 1 written
        source.fill_(3)
        save3 = stage_buckets(buckets, True, key)  # into the cached buffers again
        save2.release()  # save 2 written: must not free save 3's buffers
        source.fill_(4)
        save4 = stage_buckets(buckets, True, key)
        staged = [s[0].data[1][0][1] for s in (save1, save2, save3, save4)]
        assert [t[0].item() for t in staged[1:]] == [2.0, 3.0, 4.0]
        assert staged[2].data_ptr() != staged[3].data_ptr()
    finally:
        forget_staging_buffers()
