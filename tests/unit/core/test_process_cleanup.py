"""No background process outlives its trainer, however the trainer ends."""

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", ["temporal", "persistent"])
@pytest.mark.parametrize("how", ["normal", "raise", "sigkill"])
def test_background_process_ends_with_trainer(tmp_path, persistent, how):
    pid_file = tmp_path / "pid"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.core._trainer_script", persistent, how, str(pid_file)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=90,
    )
    # The trainer must not hang at exit waiting for its never-ending save.
    assert time.monotonic() - started < 60
    if how == "normal":
        assert proc.returncode == 0, proc.stderr
        assert "unfinalized" in proc.stderr  # the user is told the save was aborted
    elif how == "raise":
        assert proc.returncode == 1 and "trainer crashed" in proc.stderr
    else:
        assert proc.returncode == -9
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"background process {pid} outlived its trainer ({how})"


@pytest.mark.timeout(120)
def test_persistent_worker_needs_no_descriptor_per_tensor(tmp_path):
    """4,000 tensors under a 256 open-file limit: tensors travel as shared-memory references."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.core._fd_limit_script", str(tmp_path), "256", "4000"],
        cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "persistent: saved 4000 tensors twice" in proc.stdout, proc.stdout
    # Pickling would have moved every trainer tensor into shared memory in place.
    assert "trainer tensors moved to shared memory: 0" in proc.stdout, proc.stdout
    open_fds = int(proc.stdout.split("descriptors open:")[1].split()[0])
    assert open_fds < 64, proc.stdout
    assert (tmp_path / "still-writable.txt").read_text() == "ok"


@pytest.mark.timeout(180)
def test_a_worker_killed_before_reading_a_request_frees_its_staging(tmp_path):
    """Three 32 MiB saves to workers stuck at start-up: the shared memory goes with them."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.core._worker_stuck_script", str(tmp_path)],
        cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "phases: timeout,timeout,timeout" in proc.stdout, proc.stdout
    growth = int(proc.stdout.split("shm growth MiB:")[1].split()[0])
    assert growth < 32, proc.stdout  # was +32 MiB per killed worker


def test_a_child_that_survives_sigkill_is_not_waited_for_at_exit(caplog):
    # A writer stuck in uninterruptible I/O (a hung mount) outlives SIGKILL; multiprocessing's
    # exit hook would join it without a bound, so the trainer could never exit.
    import multiprocessing.process

    from megatron_async.core.process_lifetime import kill_and_reap

    class Unkillable:
        pid, joins = None, []  # no pid: nothing is really signalled

        def is_alive(self):
            return True

        def join(self, timeout=None):
            self.joins.append(timeout)

    stuck = Unkillable()
    multiprocessing.process._children.add(stuck)
    try:
        kill_and_reap(stuck, join_timeout_s=0.5)
        assert stuck.joins == [0.5]
        assert stuck not in multiprocessing.process._children
        assert "left behind" in caplog.text
    finally:
        multiprocessing.process._children.discard(stuck)
