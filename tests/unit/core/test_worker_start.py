"""The persistent worker is a fresh interpreter: it never runs the training script, and a
worker that cannot start fails the save within seconds, saying why."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_async.core import AsyncCallerConfig, AsyncCallsQueue, AsyncRequest
from megatron_async.errors import AsyncSaveFailedError
from tests import background_fns as fns

REPO_ROOT = Path(__file__).resolve().parents[3]
UNGUARDED_SCRIPT = Path(__file__).with_name("_unguarded_script.py")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("launch", ["file", "-c", "stdin"])
def test_script_without_main_guard_saves_and_its_code_runs_once(tmp_path, launch):
    source = UNGUARDED_SCRIPT.read_text()
    script_args = [str(tmp_path), str(REPO_ROOT)]
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
    queue = AsyncCallsQueue(persistent=True, config=AsyncCallerConfig(staging_timeout_s=600.0))
    try:
        started = time.monotonic()
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

        monkeypatch.undo()  # the environment is repaired: the next save starts a working worker
        queue.schedule_async_request(AsyncRequest(fns.write_text, (str(tmp_path / "b"), None, "b"), []))
        assert queue.maybe_finalize_async_calls(blocking=True) == [1]
        assert (tmp_path / "b").read_text() == "b"
    finally:
        queue.close(abort=True)
