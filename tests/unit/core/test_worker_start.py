"""The persistent worker never runs the training script, whether forked (the default) or
a fresh interpreter (``worker_start="exec"``). A fresh interpreter: a save scheduled while
it starts does not wait for it, and one that cannot start fails a save within seconds,
saying why."""

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_async.core import AsyncCallerConfig, AsyncCallsQueue, AsyncRequest
from megatron_async.errors import AsyncSaveFailedError
from tests import background_fns as fns
from tests.persistent_worker import wait_until_worker_ready

REPO_ROOT = Path(__file__).resolve().parents[3]
UNGUARDED_SCRIPT = Path(__file__).with_name("_unguarded_script.py")


EXEC = AsyncCallerConfig(worker_start="exec")


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "launch, worker_start",
    [("file", "fork"), ("file", "exec"), ("-c", "exec"), ("stdin", "exec")],
)
def test_script_without_main_guard_saves_and_its_code_runs_once(tmp_path, launch, worker_start):
    source = UNGUARDED_SCRIPT.read_text()
    script_args = [str(tmp_path), str(REPO_ROOT), worker_start]
    command, stdin = {
        "file": ([str(UNGUARDED_SCRIPT), *script_args], None),
        "-c": (["-c", source, *script_args], None),
        "stdin": (["-", *script_args], source),
    }[launch]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # Well under staging_timeout_s (600 s), which a worker that never starts would take.
    proc = subprocess.run(
        [sys.executable, *command], input=stdin, cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trainer_pid = int(proc.stdout.split("trainer pid:")[1].split()[0])
    runs = (tmp_path / "top_level_runs").read_text().split()
    assert runs == [str(trainer_pid)], f"the script's top-level code ran in {runs}"
    assert int(proc.stdout.split("worker pid:")[1].split()[0]) != trainer_pid
    assert "same package: True" in proc.stdout  # this checkout, from the trainer's sys.path
    assert "worker env: 1" in proc.stdout
    assert "failed save: disk on fire" in proc.stdout
    # Once started, the worker writes to the trainer's stderr.
    assert "worker: async call 1 failed while writing: disk on fire" in proc.stderr, proc.stderr[-3000:]


def _break_interpreter(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'simulated: cannot load libpython3.11.so' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    return ["exited with code 3 while starting", "simulated: cannot load libpython3.11.so"]


def _break_import(tmp_path, monkeypatch):
    package = tmp_path / "shadow" / "megatron_async"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("simulated broken install")\n')
    monkeypatch.syspath_prepend(str(package.parent))  # the worker gets this sys.path
    return ["exited with code 1 while starting", "ImportError: simulated broken install"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("breakage", [_break_interpreter, _break_import], ids=["interpreter", "import"])
def test_worker_that_cannot_start_fails_the_save_fast_with_its_stderr(tmp_path, monkeypatch, breakage):
    expected = breakage(tmp_path, monkeypatch)
    queue = AsyncCallsQueue(
        persistent=True, config=AsyncCallerConfig(staging_timeout_s=600.0, worker_start="exec")
    )
    try:
        started = time.monotonic()
        queue.persistent_caller.process.join(timeout=60)  # it dies while starting
        assert queue.persistent_caller.process.exitcode is not None
        queue.schedule_async_request(AsyncRequest(fns.write_text, (str(tmp_path / "a"), None, "a"), []))
        with pytest.raises(AsyncSaveFailedError) as info:
            queue.maybe_finalize_async_calls(blocking=True)
        assert time.monotonic() - started < 60, "waited for staging_timeout_s"
        failure = info.value.rank_failures[0]
        assert failure.phase == "worker"
        for text in expected:
            assert text in failure.message, failure.message
        assert "AsyncCallsQueue(persistent=False)" in failure.message  # what to do
        assert not (tmp_path / "a").exists()

        # The environment is repaired: the next save starts a working worker, and runs
        # forked while it starts; the one after goes to the worker.
        monkeypatch.undo()
        queue.schedule_async_request(AsyncRequest(fns.write_text, (str(tmp_path / "b"), None, "b"), []))
        assert queue.maybe_finalize_async_calls(blocking=True) == [1]
        assert (tmp_path / "b").read_text() == "b"
        wait_until_worker_ready(queue)
        queue.schedule_async_request(AsyncRequest(fns.write_worker_facts, (str(tmp_path / "c"), None), []))
        assert queue.maybe_finalize_async_calls(blocking=True) == [2]
        assert json.loads((tmp_path / "c").read_text())["pid"] == queue.persistent_caller.process.pid
    finally:
        queue.close(abort=True)


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # already gone


@pytest.mark.timeout(240)
def test_save_scheduled_while_the_worker_starts_runs_forked_and_later_saves_use_the_worker(tmp_path):
    queue = AsyncCallsQueue(persistent=True, config=EXEC)
    caller = queue.persistent_caller
    worker_pid = caller.process.pid
    _stop(worker_pid)  # its start-up cannot finish before the first save
    try:
        assert not caller.is_worker_ready()
        tensor = torch.arange(1000, dtype=torch.float32)
        expected = tensor.clone()
        for idx in range(2):  # both scheduled before the worker is ready
            queue.schedule_async_request(AsyncRequest(
                fns.save_staged_tensor_and_pid, (str(tmp_path / f"{idx}.pt"), None), [],
                preload_fn=functools.partial(fns.stage_clone, tensor),
            ))
            tensor.mul_(-1).add_(7)  # in place, right after scheduling
        assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
        first, second = (torch.load(tmp_path / f"{idx}.pt") for idx in range(2))
        assert torch.equal(first["tensor"], expected)
        assert torch.equal(second["tensor"], expected.mul(-1).add(7))
        for saved in (first, second):
            assert saved["pid"] not in (os.getpid(), worker_pid)  # a forked process wrote it

        _resume(worker_pid)
        wait_until_worker_ready(queue)
        expected = tensor.clone()
        queue.schedule_async_request(AsyncRequest(
            fns.save_staged_tensor_and_pid, (str(tmp_path / "2.pt"), None), [],
            preload_fn=functools.partial(fns.stage_clone, tensor),
        ))
        tensor.add_(1000)
        assert queue.maybe_finalize_async_calls(blocking=True) == [2]
        third = torch.load(tmp_path / "2.pt")
        assert torch.equal(third["tensor"], expected)
        assert third["pid"] == worker_pid == caller.process.pid  # the same, ready worker
    finally:
        _resume(worker_pid)
        queue.close(abort=True)


@pytest.mark.timeout(180)
def test_worker_that_never_becomes_ready_fails_a_save_after_staging_timeout(tmp_path):
    queue = AsyncCallsQueue(
        persistent=True, config=AsyncCallerConfig(staging_timeout_s=1.0, worker_start="exec")
    )
    stuck_pid = queue.persistent_caller.process.pid
    _stop(stuck_pid)  # stuck at start-up
    try:
        queue.schedule_async_request(AsyncRequest(fns.write_text, (str(tmp_path / "a"), None, "a"), []))
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]  # ran forked meanwhile
        assert (tmp_path / "a").read_text() == "a"
        time.sleep(1.5)  # past staging_timeout_s since the worker was started
        queue.schedule_async_request(AsyncRequest(fns.write_text, (str(tmp_path / "b"), None, "b"), []))
        with pytest.raises(AsyncSaveFailedError, match="did not start within staging_timeout_s=1s") as info:
            queue.maybe_finalize_async_calls(blocking=True)
        assert info.value.rank_failures[0].phase == "timeout"
        assert not (tmp_path / "b").exists()
        deadline = time.monotonic() + 30
        while _alive(stuck_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(stuck_pid), "the worker stuck at start-up must be killed"
        # The next save starts a fresh worker and, while it starts, runs forked.
        queue.schedule_async_request(AsyncRequest(fns.write_text, (str(tmp_path / "c"), None, "c"), []))
        assert queue.maybe_finalize_async_calls(blocking=True) == [2]
        assert (tmp_path / "c").read_text() == "c"
        assert queue.persistent_caller.process.pid != stuck_pid
    finally:
        _resume(stuck_pid)
        queue.close(abort=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
