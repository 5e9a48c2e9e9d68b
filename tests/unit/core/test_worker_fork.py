"""The persistent worker is a fork of the trainer: ready at once, it gives up its share
of the trainer's tensor pages and staging segments, resets the trainer's signal handlers,
and a fork that fails, or a child that fails while starting, fails the save."""

import functools
import os
import select
import signal
import socket
import time

import pytest
import torch

from megatron_async.core import AsyncCallerConfig, AsyncCallsQueue, AsyncRequest
from megatron_async.core import worker_loop, worker_process
from megatron_async.core.shared_memory import allocate_segment, segment_view
from megatron_async.errors import AsyncSaveFailedError
from tests import background_fns as fns
from tests.persistent_worker import wait_until_worker_ready

MIB = 2**20


def _private_dirty_kib(pid: int) -> int:
    """Memory that ``pid`` alone holds and has written (or whose sharer wrote its copy), in KiB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    raise AssertionError("no Private_Dirty line in smaps_rollup")


def _save_tensor(queue: AsyncCallsQueue, path, tensor: torch.Tensor) -> None:
    queue.schedule_async_request(AsyncRequest(
        fns.save_staged_tensor_and_pid, (str(path), None), [],
        preload_fn=functools.partial(fns.stage_clone, tensor),
    ))


@pytest.mark.timeout(120)
def test_forked_worker_is_ready_at_once_and_holds_none_of_the_trainers_tensor_pages(tmp_path):
    state = torch.ones(256 * MIB // 4)  # CPU-resident state, e.g. an offloaded optimizer
    queue = AsyncCallsQueue(persistent=True)
    caller = queue.persistent_caller
    try:
        wait_until_worker_ready(queue)  # a fork needs no imports: this takes milliseconds
        worker_pid = caller.process.pid
        # The trainer updates its state in place after the fork. A worker that kept its
        # copy-on-write share would now hold the old 256 MiB privately.
        state.add_(1)
        held_kib = _private_dirty_kib(worker_pid)
        assert held_kib * 1024 < state.nbytes // 2, f"the worker holds {held_kib} KiB privately"
        assert torch.equal(state[:: 2**20], torch.full_like(state[:: 2**20], 2.0))  # the trainer's own

        small = torch.arange(1000, dtype=torch.float32)
        expected = small.clone()
        _save_tensor(queue, tmp_path / "0.pt", small)
        small.mul_(-1)  # in place, right after scheduling
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        saved = torch.load(tmp_path / "0.pt")
        assert torch.equal(saved["tensor"], expected)
        assert saved["pid"] == worker_pid  # the forked worker wrote it
    finally:
        queue.close(abort=True)


@pytest.mark.timeout(120)
def test_forked_worker_keeps_none_of_the_trainers_descriptors_open(tmp_path):
    read_end, write_end = os.pipe()
    listener = socket.create_server(("127.0.0.1", 0))  # e.g. a rendezvous store's port
    port = listener.getsockname()[1]
    queue = wait_until_worker_ready(AsyncCallsQueue(persistent=True))
    try:
        os.close(write_end)  # the pipe's reader must see EOF now, not when the worker exits
        readable, _, _ = select.select([read_end], [], [], 5.0)
        assert readable and os.read(read_end, 1) == b"", "the worker holds the pipe's write end"
        listener.close()  # the port must be free to bind again
        socket.create_server(("127.0.0.1", port)).close()
        # The worker still writes (its own sockets and stderr survived).
        _save_tensor(queue, tmp_path / "0.pt", torch.ones(3))
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        assert torch.equal(torch.load(tmp_path / "0.pt")["tensor"], torch.ones(3))
    finally:
        os.close(read_end)
        queue.close(abort=True)


def _record_signal(path, signum, frame):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


@pytest.mark.timeout(120)
def test_trainer_signal_handler_does_not_run_in_the_worker(tmp_path):
    ran = tmp_path / "handler_ran"
    previous = signal.signal(signal.SIGUSR1, functools.partial(_record_signal, str(ran)))
    queue = wait_until_worker_ready(AsyncCallsQueue(persistent=True))
    caller = queue.persistent_caller
    try:
        os.kill(caller.process.pid, signal.SIGUSR1)  # a fresh interpreter dies of it: so must the fork
        caller.process.join(timeout=30)
        assert caller.process.exitcode == -signal.SIGUSR1
        assert not ran.exists(), "the trainer's SIGUSR1 handler ran in the worker"
    finally:
        signal.signal(signal.SIGUSR1, previous)
        queue.close(abort=True)


def _mapping_at(pid: int, address: int) -> str:
    """The line of ``pid``'s memory map for the mapping that starts at ``address``."""
    with open(f"/proc/{pid}/maps") as f:
        return next(line for line in f if line.startswith(f"{address:x}-"))


@pytest.mark.timeout(120)
def test_worker_restarted_while_staging_buffers_are_alive_holds_none_of_them(tmp_path):
    queue = wait_until_worker_ready(AsyncCallsQueue(persistent=True))
    caller = queue.persistent_caller
    try:
        held = allocate_segment(16 * MIB, reusable=True)  # kept for the next save, as a strategy does
        staged = segment_view(held, 0, (1000,), torch.float32)
        os.kill(caller.process.pid, signal.SIGKILL)  # the restart happens while it is alive
        caller.process.join(timeout=30)
        staged.copy_(torch.arange(1000, dtype=torch.float32))
        queue.schedule_async_request(AsyncRequest(fns.save_staged_tensor_and_pid, (str(tmp_path / "0.pt"), staged), []))
        wait_until_worker_ready(queue)
        segment_file = _mapping_at(os.getpid(), held.data_ptr()).split()[5]  # /dev/shm/...
        inherited = _mapping_at(caller.process.pid, held.data_ptr())
        assert segment_file not in inherited and " rw-p " in inherited, inherited  # private zero pages
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        saved = torch.load(tmp_path / "0.pt")
        assert saved["pid"] == caller.process.pid  # a forked worker, which got the segment by descriptor
        assert torch.equal(saved["tensor"], torch.arange(1000, dtype=torch.float32))
    finally:
        queue.close(abort=True)


def _fail_to_release(ranges):
    raise RuntimeError("simulated failure in the forked worker's set-up")


@pytest.mark.timeout(120)
def test_fork_that_fails_while_starting_fails_the_next_save_saying_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_loop, "release_inherited_pages", _fail_to_release)
    queue = AsyncCallsQueue(persistent=True)
    try:
        caller = queue.persistent_caller
        caller.process.join(timeout=30)  # it dies while starting
        assert caller.process.exitcode == 1
        _save_tensor(queue, tmp_path / "0.pt", torch.zeros(10))
        with pytest.raises(AsyncSaveFailedError) as info:
            queue.maybe_finalize_async_calls(blocking=True)
        failure = info.value.rank_failures[0]
        assert failure.phase == "worker"
        assert "exited with code 1 while starting" in failure.message
        assert "stderr" in failure.message  # where its traceback is
        assert not (tmp_path / "0.pt").exists()

        monkeypatch.undo()  # repaired: the next save forks a working worker
        _save_tensor(queue, tmp_path / "1.pt", torch.ones(10))
        assert queue.maybe_finalize_async_calls(blocking=True) == [1]
        assert torch.equal(torch.load(tmp_path / "1.pt")["tensor"], torch.ones(10))
    finally:
        queue.close(abort=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(120)
def test_forked_worker_of_a_cuda_trainer_writes_staged_tensors_and_refuses_unstaged_ones(tmp_path):
    torch.cuda.init()
    weights = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    expected = weights.cpu()
    queue = wait_until_worker_ready(AsyncCallsQueue(persistent=True))
    try:
        queue.schedule_async_request(AsyncRequest(
            fns.save_staged_tensor, (str(tmp_path / "0.pt"), None), [],
            preload_fn=functools.partial(fns.stage_in_shared_memory, weights),
        ))
        weights.add_(1)
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        assert torch.equal(torch.load(tmp_path / "0.pt"), expected)

        # A CUDA tensor handed over without staging cannot reach a forked worker.
        queue.schedule_async_request(AsyncRequest(fns.save_staged_tensor, (str(tmp_path / "1.pt"), weights), []))
        with pytest.raises(AsyncSaveFailedError, match="cannot use CUDA") as info:
            queue.maybe_finalize_async_calls(blocking=True)
        assert info.value.rank_failures[0].phase == "schedule"
        assert "preload_fn" in info.value.rank_failures[0].message  # what to do
        worker_pid = queue.persistent_caller.process.pid
        queue.schedule_async_request(AsyncRequest(
            fns.save_staged_tensor, (str(tmp_path / "2.pt"), None), [],
            preload_fn=functools.partial(fns.stage_in_shared_memory, weights),
        ))
        assert queue.maybe_finalize_async_calls(blocking=True) == [2]
        assert queue.persistent_caller.process.pid == worker_pid  # the worker stayed up
        assert torch.equal(torch.load(tmp_path / "2.pt"), expected + 1)
    finally:
        queue.close(abort=True)


@pytest.mark.timeout(120)
def test_closing_a_stuck_forked_worker_is_bounded_by_close_timeout_s(tmp_path):
    queue = wait_until_worker_ready(
        AsyncCallsQueue(persistent=True, config=AsyncCallerConfig(close_timeout_s=1.0))
    )
    worker_pid = queue.persistent_caller.process.pid
    os.kill(worker_pid, signal.SIGSTOP)  # e.g. stuck in a write to a hung file system
    try:
        started = time.monotonic()
        queue.close()  # asks it to stop, waits close_timeout_s, then kills it
        assert time.monotonic() - started < 30, "close() waited past close_timeout_s"
        with pytest.raises(ChildProcessError):  # killed and reaped
            os.waitpid(worker_pid, os.WNOHANG)
    finally:
        try:
            os.kill(worker_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fork_fails():
    raise OSError(11, "simulated: Resource temporarily unavailable")


@pytest.mark.timeout(120)
def test_a_fork_that_fails_fails_the_save_and_the_next_save_forks_again(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(worker_process.os, "fork", _fork_fails)
        queue = AsyncCallsQueue(persistent=True)  # logged: the first save tries again
        assert queue.persistent_caller.process is None
        _save_tensor(queue, tmp_path / "0.pt", torch.ones(4))
        with pytest.raises(AsyncSaveFailedError) as info:
            queue.maybe_finalize_async_calls(blocking=True)
    try:
        failure = info.value.rank_failures[0]
        assert failure.phase == "schedule"
        assert "cannot fork the persistent checkpoint worker" in failure.message
        assert "Resource temporarily unavailable" in failure.message
        assert not (tmp_path / "0.pt").exists()
        _save_tensor(queue, tmp_path / "1.pt", torch.ones(4))
        assert queue.maybe_finalize_async_calls(blocking=True) == [1]
        assert torch.load(tmp_path / "1.pt")["pid"] == queue.persistent_caller.process.pid
    finally:
        queue.close(abort=True)
