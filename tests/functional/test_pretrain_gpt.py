"""End-to-end tests of examples/pretrain_gpt.py: exact resume and crash consistency.

Each launch is a real ``torchrun --nproc-per-node 2`` job on gloo with a tiny GPT
(2 layers, hidden 64, sequence 32, vocabulary 256) and dropout on, so a resume is exact
only if model, optimizer, every RNG state and the data position all come back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_async.manager import is_complete_checkpoint, read_tracker

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "pretrain_gpt.py")
LAUNCH_TIMEOUT_S = 150
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--micro-batch-size", "2", "--log-interval", "1"]


def _command(flags):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", SCRIPT, *TINY_MODEL, *flags]


def _env(extra=None):
    pythonpath = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath)
    env.update(extra or {})
    return env


def run_pretrain(flags, metrics_file):
    """Run one job to completion; return its metrics (rank 0's JSON lines)."""
    proc = subprocess.run(
        _command([*flags, "--metrics-file", str(metrics_file)]),
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"pretrain_gpt.py exited with {proc.returncode}\n--- stdout ---\n"
            f"{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return read_metrics(metrics_file)


def kill_job(proc):
    """SIGKILL torchrun, every rank and every background writer, all at once.

    torchrun starts each rank in a session of its own, so the job is found through the
    process tree rather than a process group.
    """
    tree = [psutil.Process(proc.pid)]
    try:
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    for process in tree:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, f"processes survived SIGKILL: {alive}"
    proc.wait(timeout=30)


def read_metrics(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(metrics):
    return {m["iteration"]: m["loss"] for m in metrics if m["event"] == "iteration"}


def events(metrics, kind):
    return [m for m in metrics if m["event"] == kind]


N = 3
RESUME_CASES = {
    "async-fork-tp1-distopt-fullyparallel": [
        "--async-save", "--use-distributed-optimizer", "--ckpt-fully-parallel-save"],
    "async-persistent-tp2-plain": [
        "--async-save", "--use-persistent-ckpt-worker", "--tensor-model-parallel-size", "2",
        "--ckpt-assume-constant-structure"],
    "sync-tp1-plain-accumulation": ["--global-batch-size", "8"],
}


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_resume_reproduces_the_uninterrupted_losses(tmp_path, case):
    """Train 2N iterations straight (saving at N and 2N); restart from the checkpoint at
    N in a new job and train N more: the last N losses are bit-identical."""
    flags = RESUME_CASES[case]
    straight = run_pretrain(
        [*flags, "--train-iters", str(2 * N), "--save", str(tmp_path / "a"),
         "--save-interval", str(N)],
        tmp_path / "straight.jsonl",
    )
    assert sorted(losses(straight)) == list(range(1, 2 * N + 1))
    assert [e["iteration"] for e in events(straight, "save")] == [N, 2 * N]
    assert read_tracker(str(tmp_path / "a")) == 2 * N

    resumed = run_pretrain(
        [*flags, "--train-iters", str(2 * N), "--load", str(tmp_path / "a"),
         "--ckpt-step", str(N), "--save", str(tmp_path / "b"), "--save-interval", str(N)],
        tmp_path / "resumed.jsonl",
    )
    assert [e["iteration"] for e in events(resumed, "resume")] == [N]
    expected = {i: loss for i, loss in losses(straight).items() if i > N}
    assert losses(resumed) == expected


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)
def test_kill_during_async_save_resumes_from_last_complete_checkpoint(tmp_path):
    """SIGKILL every process of the job while the save of iteration 4 is still being
    written: the tracker keeps pointing at 2, iteration 4 is incomplete, and the next run
    resumes from 2 and reproduces the killed run's losses."""
    save_dir = tmp_path / "ckpt"
    flags = ["--async-save", "--train-iters", "8", "--save", str(save_dir), "--load",
             str(save_dir), "--save-interval", "2"]
    killed_metrics = tmp_path / "killed.jsonl"
    log_path = tmp_path / "killed.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _command([*flags, "--metrics-file", str(killed_metrics)]),
            cwd=REPO, env=_env({"PRETRAIN_GPT_DEBUG_SAVE_DELAY": "4:600"}),
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        # Kill once the save of 2 is committed and training went on past 4 (whose
        # background write the debug knob holds open).
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while True:
            metrics = read_metrics(killed_metrics)
            if events(metrics, "save") and max(losses(metrics), default=0) >= 5:
                break
            if proc.poll() is not None:
                raise AssertionError(f"job ended early:\n{log_path.read_text()[-6000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("the job did not commit iteration 2 and reach 5 in time")
            time.sleep(0.2)
    finally:
        kill_job(proc)

    killed = read_metrics(killed_metrics)
    assert [e["iteration"] for e in events(killed, "save")] == [2]
    assert read_tracker(str(save_dir)) == 2
    assert not is_complete_checkpoint(str(save_dir / "iter_0000004"))

    rerun = run_pretrain(flags, tmp_path / "rerun.jsonl")
    assert [e["iteration"] for e in events(rerun, "resume")] == [2]
    overlap = {i: loss for i, loss in losses(killed).items() if i > 2}
    assert {i: losses(rerun)[i] for i in overlap} == overlap
    assert read_tracker(str(save_dir)) == 8
    assert is_complete_checkpoint(str(save_dir / "iter_0000004"))
