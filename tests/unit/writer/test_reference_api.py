"""FileSystemWriterAsync's entry points called the way the reference API documents them.

Code written against nvidia-resiliency-ext's and megatron-core's ``filesystem_async``
calls the static write paths itself, passes its own results queue, or overrides a write
path in a subclass; each of these must work with our writer (single process).
"""

from __future__ import annotations

import builtins
import io
import multiprocessing as mp
import queue
import time
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from megatron_async.errors import CheckpointValidationError
from megatron_async.filesystem_async import (
    ConsistentDataIdentifier,
    FileSystemWriterAsync,
    get_write_results_queue,
)
from megatron_async.saver.state_dict_saver import save_state_dict_async_plan
from tests.staging_aids import forget_staging_buffers

pytestmark = pytest.mark.timeout(120)

_STATE = {"a": torch.arange(16, dtype=torch.float32), "b": torch.ones(8), "c": torch.full((4,), 3.0)}


def _prepared(tmp_path, writer_cls=FileSystemWriterAsync, **kwargs) -> FileSystemWriterAsync:
    """Plan a single-process save with ``save_state_dict_async_plan`` (the reference flow)."""
    writer = writer_cls(str(tmp_path), **kwargs)
    (prepared, _metadata, _wrapper), *_ = save_state_dict_async_plan(dict(_STATE), writer)
    assert prepared is writer
    return writer


def _finish(writer: FileSystemWriterAsync, results) -> None:
    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(_STATE), is_coordinator=True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    _, metadata = planner.create_global_plan([local_plan])
    writer.finish(metadata, [results])


def _assert_loads_back(tmp_path) -> None:
    loaded = {k: torch.zeros_like(v) for k, v in _STATE.items()}
    dcp.load(loaded, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    for key, tensor in _STATE.items():
        assert torch.equal(loaded[key], tensor), key


def test_the_documented_flow_with_the_reference_argument_layout(tmp_path):
    writer = _prepared(tmp_path, thread_count=2)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    assert len(args) == 3 and args[1] is None  # [rank, placeholder for the staged data, queue]
    # save_fn binds (transform_list, use_msc, open_file): the first three parameters.
    assert save_fn.args[1] is False and save_fn.args[2] is builtins.open
    args[1] = preload_fn()
    save_fn(*args)
    results = writer.retrieve_write_results()
    assert len(results) == len(_STATE)
    _finish(writer, results)
    _assert_loads_back(tmp_path)


def test_preload_tensors_takes_resolved_plan_data(tmp_path):
    writer = _prepared(tmp_path, use_cached_data_structure=True)
    checkpoint_dir, (identifier, buckets) = writer.resolved_plan_data
    assert checkpoint_dir == str(tmp_path) and isinstance(identifier, ConsistentDataIdentifier)
    staged = FileSystemWriterAsync.preload_tensors(writer.resolved_plan_data, non_blocking=True)
    assert [b.file_name for b in staged] == [b.file_name for b in buckets]
    staged.release()
    forget_staging_buffers()
    plain = _prepared(tmp_path / "plain")
    assert plain.resolved_plan_data[1][0] is None  # no reuse without the switch
    with pytest.raises(CheckpointValidationError, match="resolved_plan_data"):
        FileSystemWriterAsync.preload_tensors(buckets)  # the bare bucket list is not the layout


def test_write_preloaded_data_returns_or_queues_its_outcome(tmp_path):
    writer = _prepared(tmp_path, thread_count=1)
    (bucket,) = writer.preload_tensors(writer.resolved_plan_data)
    transforms = writer.transforms
    # Main-thread worker: no queues, the outcome is returned.
    idx, results = FileSystemWriterAsync.write_preloaded_data(
        transforms, open, 0, bucket, None, None, True
    )
    assert idx == 0 and len(results) == len(_STATE)
    # Thread worker: outcome queued, completion marked on the count queue.
    results_queue, count_queue = queue.Queue(), queue.Queue()
    count_queue.put(0)
    returned = FileSystemWriterAsync.write_preloaded_data(
        transforms, open, 5, bucket, results_queue, count_queue, False, compute_checksums=False
    )
    assert returned is None and count_queue.empty()
    idx, results = results_queue.get_nowait()
    assert idx == 5 and all(r.checksum is None for r in results)
    # A failure is returned as the exception, not raised.
    missing = bucket._replace(file_path=str(tmp_path / "no-such-dir" / "f.distcp"))
    idx, error = FileSystemWriterAsync.write_preloaded_data(transforms, open, 1, missing, None, None, True)
    assert idx == 1 and isinstance(error, FileNotFoundError)


def test_write_preloaded_data_proc_reports_from_a_process(tmp_path):
    writer = _prepared(tmp_path, thread_count=1)
    (bucket,) = writer.preload_tensors(writer.resolved_plan_data)
    ctx = mp.get_context("fork")
    results_queue, count_queue = ctx.Queue(), ctx.JoinableQueue()
    count_queue.put(0)
    proc = ctx.Process(
        target=FileSystemWriterAsync.write_preloaded_data_proc,
        args=(writer.transforms, open, 0, bucket, results_queue, count_queue, True),
    )
    proc.start()
    idx, results = results_queue.get(timeout=60)
    proc.join(60)
    assert proc.exitcode == 0 and idx == 0 and len(results) == len(_STATE)


@pytest.mark.parametrize("multiproc", [False, True], ids=["multithread", "multiproc"])
def test_static_write_paths_with_a_caller_given_queue(tmp_path, multiproc):
    writer = _prepared(tmp_path, thread_count=2)
    staged = writer.preload_tensors(writer.resolved_plan_data)
    results_queue = queue.Queue()
    write = (
        FileSystemWriterAsync.write_preloaded_data_multiproc
        if multiproc
        else FileSystemWriterAsync.write_preloaded_data_multithread
    )
    write(writer.transforms, False, open, 0, staged, results_queue)
    by_bucket = results_queue.get_nowait()
    assert isinstance(by_bucket, dict) and sorted(by_bucket) == [0, 1]
    assert sum(len(r) for r in by_bucket.values()) == len(_STATE)


def test_a_results_queue_from_get_write_results_queue_is_read_back(tmp_path):
    writer = _prepared(tmp_path, thread_count=2)
    writer.results_queue = get_write_results_queue()  # what reference-API code does
    assert get_write_results_queue() is writer.results_queue  # one per process and mode
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    save_fn(args[0], preload_fn(), args[2])
    assert len(writer.retrieve_write_results()) == len(_STATE)
    with pytest.raises(CheckpointValidationError, match="mp_mode"):
        get_write_results_queue("threads")


def test_use_msc_without_an_object_store_opener_fails_clearly(tmp_path):
    writer = _prepared(tmp_path, thread_count=1)
    staged = writer.preload_tensors(writer.resolved_plan_data)
    results_queue = queue.Queue()
    FileSystemWriterAsync.write_preloaded_data_multithread(
        writer.transforms, True, open, 0, staged, results_queue
    )
    error = results_queue.get_nowait()
    assert "use_msc=True needs an object-store open_file" in str(error)
    assert isinstance(error.failure.exception(), CheckpointValidationError)


class _RecordingOpener:
    """An ``open_file`` that is not the built-in: how an object store plugs in."""

    def __init__(self):
        self.opened = []

    def __call__(self, path, mode):
        self.opened.append((path, mode))
        return io.open(path, mode)


def test_a_caller_given_open_file_opens_every_file(tmp_path):
    writer = _prepared(tmp_path, thread_count=2)
    staged = writer.preload_tensors(writer.resolved_plan_data)
    opener, results_queue = _RecordingOpener(), queue.Queue()
    FileSystemWriterAsync.write_preloaded_data_multithread(
        writer.transforms, False, opener, 0, staged, results_queue
    )
    by_bucket = results_queue.get_nowait()
    assert sorted(path for path, _ in opener.opened) == sorted(b.file_path for b in staged)
    _finish(writer, [r for idx in sorted(by_bucket) for r in by_bucket[idx]])
    _assert_loads_back(tmp_path)


class _CountingWriter(FileSystemWriterAsync):
    """Overrides one bucket's write the reference way and delegates to the parent."""

    @staticmethod
    def write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs):
        with open(bucket.file_path + ".seen", "w"):
            pass
        return FileSystemWriterAsync.write_preloaded_data(
            transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs
        )


class _ReferenceSignatureWriter(FileSystemWriterAsync):
    """Overrides the whole multithread path with the reference signature only."""

    @staticmethod
    def write_preloaded_data_multithread(transform_list, use_msc, open_file, rank, write_buckets, global_results_queue):
        with open(f"{write_buckets[0].file_path}.override", "w"):
            pass
        FileSystemWriterAsync.write_preloaded_data_multithread(
            transform_list, use_msc, open_file, rank, write_buckets, global_results_queue
        )


@pytest.mark.parametrize("writer_cls", [_CountingWriter, _ReferenceSignatureWriter])
def test_subclass_overrides_of_write_paths_are_used(tmp_path, writer_cls):
    writer = _prepared(tmp_path, writer_cls, thread_count=2)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    save_fn(args[0], preload_fn(), args[2])
    results = writer.retrieve_write_results()
    assert len(results) == len(_STATE)
    marks = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".seen", ".override"))
    if writer_cls is _CountingWriter:
        assert marks == sorted(b.file_name + ".seen" for b in writer.write_buckets)
    else:
        assert marks == [writer.write_buckets[0].file_name + ".override"]
    _finish(writer, results)
    _assert_loads_back(tmp_path)


def test_a_failed_write_comes_back_as_dcps_wrapped_exception(tmp_path):
    writer = _prepared(tmp_path, thread_count=1)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    staged = preload_fn()
    staged[0] = staged[0]._replace(file_path=str(tmp_path / "gone" / staged[0].file_name))
    save_fn(args[0], staged, args[2])
    exc, stack = writer.retrieve_write_results()
    assert isinstance(stack, traceback.StackSummary) and stack
    assert isinstance(exc.failure.exception(), FileNotFoundError)


class _CountingPlanner(DefaultSavePlanner):
    local_plans = 0

    def create_local_plan(self):
        type(self).local_plans += 1
        return super().create_local_plan()


def test_validated_cache_reuse_skips_the_local_planning(tmp_path):
    (_, _, _), central, local, reused, _ = save_state_dict_async_plan(
        dict(_STATE), FileSystemWriterAsync(str(tmp_path / "first")), planner=_CountingPlanner()
    )
    assert _CountingPlanner.local_plans == 1 and not reused
    # Not vouched for: a fresh local plan is made and compared.
    *_, reused, _ = save_state_dict_async_plan(
        dict(_STATE), FileSystemWriterAsync(str(tmp_path / "second")), planner=_CountingPlanner(),
        cached_ckpt_structure=(central, local, False),
    )
    assert _CountingPlanner.local_plans == 2 and reused
    # Vouched for (megatron-core's validated_cache_reuse): the cached local plan is used.
    (writer, metadata, _), *_, reused, _ = save_state_dict_async_plan(
        dict(_STATE), FileSystemWriterAsync(str(tmp_path / "third")), planner=_CountingPlanner(),
        cached_ckpt_structure=(central, local, True),
    )
    assert _CountingPlanner.local_plans == 2 and reused and metadata is None
    assert len(writer.write_buckets) >= 1


def test_a_planned_rewrite_unmarks_the_checkpoint_first_and_a_refused_one_does_not(tmp_path):
    """DCP rewrites data files in place beside the old .metadata: a save that fails midway
    would leave a torn checkpoint that reads as complete. Once planning succeeded the
    coordinator removes the markers; a save that planning refuses leaves them."""
    writer = _prepared(tmp_path, thread_count=1)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    args[1] = preload_fn()
    save_fn(*args)
    _finish(writer, writer.retrieve_write_results())
    (tmp_path / "metadata.json").write_text("{}")
    _assert_loads_back(tmp_path)

    class RefusingPlanner(DefaultSavePlanner):
        def finish_plan(self, plan):
            raise ValueError("refused while planning (injected)")

    with pytest.raises(CheckpointValidationError, match="ValueError: refused while planning"):
        save_state_dict_async_plan(dict(_STATE), FileSystemWriterAsync(str(tmp_path)), planner=RefusingPlanner())
    assert (tmp_path / ".metadata").exists() and (tmp_path / "metadata.json").exists()
    _assert_loads_back(tmp_path)

    _prepared(tmp_path, thread_count=1)  # planned: its files are rewritten from now on
    assert not (tmp_path / ".metadata").exists() and not (tmp_path / "metadata.json").exists()


def test_a_save_after_a_metadata_write_was_left_behind_is_refused(tmp_path, monkeypatch):
    """A .metadata write left behind on a hung mount may land over newer data files: the
    process plans no more saves (restart the job), even once the write returned."""
    import threading

    from megatron_async.core import save_directories
    from megatron_async.core.save_directories import FileSystemStepTimeoutError
    from megatron_async.errors import CheckpointInProgressError
    from megatron_async.writer import commit

    recovered = threading.Event()

    class HungStorage:
        def sync(self, path):
            recovered.wait()

    writer = _prepared(tmp_path, thread_count=1)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    args[1] = preload_fn()
    save_fn(*args)
    monkeypatch.setattr(save_directories, "coordinator_step_timeout_s", lambda: 0.2)
    monkeypatch.setattr(commit, "storage_for", lambda path: HungStorage())
    try:
        with pytest.raises(FileSystemStepTimeoutError):
            _finish(writer, writer.retrieve_write_results())
    finally:
        recovered.set()
    with pytest.raises(CheckpointInProgressError, match="writing .metadata of .* did not return in time.*restart the job"):
        save_state_dict_async_plan(dict(_STATE), FileSystemWriterAsync(str(tmp_path / "next")))
