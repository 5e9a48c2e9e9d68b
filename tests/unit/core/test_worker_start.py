"""The persistent worker never runs the training script. A save scheduled while it starts
waits in its socket without blocking the trainer, and a worker that never becomes ready
fails the save after ``fork_start_timeout_s``."""

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_async.core import AsyncCallerConfig, AsyncCallsQueue, AsyncRequest, worker_loop
from megatron_async.errors import AsyncSaveFailedError
from tests import background_fns as fns

REPO_ROOT = Path(__file__).resolve().parents[3]
UNGUARDED_SCRIPT = Path(__file__).with_name("_unguarded_script.py")


@pytest.mark.timeout(180)
def test_script_without_main_guard_saves_and_its_code_runs_once(tmp_path):
    command = [str(UNGUARDED_SCRIPT), str(tmp_path), str(REPO_ROOT)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, *command], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trainer_pid = int(proc.stdout.split("trainer pid:")[1].split()[0])
    runs = (tmp_path / "top_level_runs").read_text().split()
    assert runs == [str(trainer_pid)], f"the script's top-level code ran in {runs}"
    assert int(proc.stdout.split("worker pid:")[1].split()[0]) != trainer_pid
    assert "failed save: disk on fire" in proc.stdout
    # Once started, the worker writes to the trainer's stderr.
    assert "worker: async call 1 failed while writing: disk on fire" in proc.stderr, proc.stderr[-3000:]


def _start_when(flag) -> object:
    """A stand-in for the forked child's first set-up step that waits for ``flag`` (a path
    that never appears: a start-up that hangs)."""

    def wait(ranges):
        while not os.path.exists(flag):
            time.sleep(0.02)

    return wait


@pytest.mark.timeout(120)
def test_save_scheduled_while_the_worker_starts_waits_for_it_without_blocking_the_trainer(
    tmp_path, monkeypatch
):
    flag = tmp_path / "start"
    monkeypatch.setattr(worker_loop, "release_inherited_pages", _start_when(flag))
    queue = AsyncCallsQueue(persistent=True)
    caller = queue.persistent_caller
    try:
        tensor = torch.arange(1000, dtype=torch.float32)
        expected = tensor.clone()
        started = time.monotonic()
        queue.schedule_async_request(AsyncRequest(
            fns.save_staged_tensor_and_pid, (str(tmp_path / "0.pt"), None), [],
            preload_fn=functools.partial(fns.stage_clone, tensor),
        ))
        assert time.monotonic() - started < 5, "scheduling waited for the worker"
        tensor.mul_(-1)  # in place, right after scheduling
        assert not caller.is_worker_ready()
        assert queue.maybe_finalize_async_calls(blocking=False) == []
        flag.touch()
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        saved = torch.load(tmp_path / "0.pt")
        assert torch.equal(saved["tensor"], expected)
        assert saved["pid"] == caller.process.pid
    finally:
        queue.close(abort=True)


@pytest.mark.timeout(120)
def test_worker_that_never_becomes_ready_fails_the_save_after_fork_start_timeout_s(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_loop, "release_inherited_pages", _start_when(tmp_path / "never"))
    queue = AsyncCallsQueue(persistent=True, config=AsyncCallerConfig(fork_start_timeout_s=1.0))
    stuck_pid = queue.persistent_caller.process.pid
    try:
        queue.schedule_async_request(AsyncRequest(fns.write_text, (str(tmp_path / "a"), None, "a"), []))
        with pytest.raises(AsyncSaveFailedError, match="did not start within fork_start_timeout_s=1s") as info:
            queue.maybe_finalize_async_calls(blocking=True)
        assert info.value.rank_failures[0].phase == "timeout"
        assert not (tmp_path / "a").exists()
        assert not _alive(stuck_pid), "the worker stuck at start-up must be killed"
        monkeypatch.undo()  # the next save forks a working worker
        queue.schedule_async_request(AsyncRequest(fns.write_text, (str(tmp_path / "b"), None, "b"), []))
        assert queue.maybe_finalize_async_calls(blocking=True) == [1]
        assert (tmp_path / "b").read_text() == "b"
        assert queue.persistent_caller.process.pid != stuck_pid
    finally:
        queue.close(abort=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
