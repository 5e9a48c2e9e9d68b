"""A save that failed, or that a closed queue refused, frees its directory at once: the
caller may retry into it while still holding the old request (one rank, gloo)."""

import gc

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_async.core import AsyncCallsQueue
from megatron_async.errors import AsyncSaveFailedError, FrozenRequestError, QueueClosedError
from megatron_async.core.save_directories import SaveDirectories
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


def _in_flight():
    """Directories that saves of this process are still writing or finalizing."""
    return SaveDirectories.of_process().directories()


def _state(step: float):
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(64.0) + step)}


def _retry_succeeds(queue, path, step):
    request = TorchDistAsyncSaveStrategy().async_save(_state(step), path)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    loaded = {"w": torch.empty(64)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(path)))
    assert torch.equal(loaded["w"], torch.arange(64.0) + step)


def test_a_failed_save_frees_its_directory_while_the_caller_holds_the_request(tmp_path):
    gc.disable()  # the claim must not wait for a collection
    queue = AsyncCallsQueue(persistent=False)
    try:
        failing = TorchDistAsyncSaveStrategy(staging_memory_limit=8)  # too small for 256 bytes
        request = failing.async_save(_state(1.0), tmp_path)
        assert str(tmp_path) in _in_flight()
        queue.schedule_async_request(request)
        with pytest.raises(AsyncSaveFailedError):
            queue.maybe_finalize_async_calls(blocking=True)
        assert str(tmp_path) not in _in_flight(), "the failed request still holds it"
        _retry_succeeds(queue, tmp_path, 2.0)
        del request
    finally:
        gc.enable()
        queue.close()


def test_a_request_refused_by_a_closed_queue_frees_its_directory(tmp_path):
    gc.disable()
    closed, queue = AsyncCallsQueue(persistent=False), AsyncCallsQueue(persistent=False)
    closed.close()
    try:
        request = TorchDistAsyncSaveStrategy().async_save(_state(1.0), tmp_path)
        with pytest.raises(QueueClosedError):
            closed.schedule_async_request(request)
        assert str(tmp_path) not in _in_flight()
        _retry_succeeds(queue, tmp_path, 3.0)
        del request
    finally:
        gc.enable()
        queue.close()


def test_a_request_scheduled_twice_is_refused_and_the_first_save_completes(tmp_path):
    queue = AsyncCallsQueue(persistent=False)
    try:
        request = TorchDistAsyncSaveStrategy().async_save(_state(4.0), tmp_path)
        queue.schedule_async_request(request)
        with pytest.raises(FrozenRequestError, match="already scheduled or run; a request runs once"):
            queue.schedule_async_request(request)
        assert queue.get_num_unfinalized_calls() == 1
        assert str(tmp_path) in _in_flight()  # the refusal did not free the first save's claim
        queue.maybe_finalize_async_calls(blocking=True)
        loaded = {"w": torch.empty(64)}
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path)))
        assert torch.equal(loaded["w"], torch.arange(64.0) + 4.0)
    finally:
        queue.close()


def test_a_request_run_synchronously_cannot_be_scheduled_or_run_again(tmp_path):
    queue = AsyncCallsQueue(persistent=False)
    try:
        request = TorchDistAsyncSaveStrategy().async_save(_state(5.0), tmp_path)
        request.execute_sync()
        for run_again in (lambda: queue.schedule_async_request(request), request.execute_sync):
            with pytest.raises(FrozenRequestError, match="already scheduled or run"):
                run_again()
        assert queue.get_num_unfinalized_calls() == 0
        _retry_succeeds(queue, tmp_path, 6.0)
    finally:
        queue.close()


@pytest.mark.parametrize("checkpoint_dir", [None, 5, b"/tmp/x"], ids=["None", "int", "bytes"])
def test_a_checkpoint_dir_that_is_no_path_is_a_validation_error(checkpoint_dir):
    from megatron_async.errors import CheckpointValidationError

    with pytest.raises(CheckpointValidationError, match="checkpoint_dir must be a path"):
        TorchDistAsyncSaveStrategy().async_save(_state(1.0), checkpoint_dir)


def test_an_invalid_copy_thread_count_is_a_validation_error(monkeypatch):
    from megatron_async.errors import CheckpointValidationError
    from megatron_async.staging import flat_copy

    monkeypatch.setenv(flat_copy.COPY_THREADS_ENV, "two")
    with pytest.raises(CheckpointValidationError, match="not an integer; set it to the number"):
        flat_copy.copy_threads()


def test_a_complete_checkpoint_rank_0_may_not_unmark_is_a_validation_error(tmp_path, monkeypatch):
    # megatron-core <= 0.18 writes common.pt before any strategy: the guard in front of it
    # must refuse with a typed error that our strategy raises on every rank, not a bare
    # PermissionError on rank 0 alone.
    from megatron.core import dist_checkpointing

    from megatron_async.errors import CheckpointValidationError
    from megatron_async.mcore import generation, target

    if generation.GENERATION != "registry" and not hasattr(
        getattr(dist_checkpointing.serialization, "save_common", None), "__megatron_async_guarded__"
    ):
        pytest.skip("this megatron-core stores the common state in the strategy (0.19+)")

    def refused(directory, storage):
        raise PermissionError(13, "Permission denied", f"{directory}/.metadata")

    monkeypatch.setattr(target, "remove_completion_markers", refused)
    with pytest.raises(CheckpointValidationError, match="rank 0: .*save into a directory you can write"):
        dist_checkpointing.save(_state(1.0), str(tmp_path), sharded_strategy=TorchDistAsyncSaveStrategy())
    assert not (tmp_path / "common.pt").exists()
