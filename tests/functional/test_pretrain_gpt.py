"""End-to-end tests of examples/pretrain_gpt.py: exact resume, resume with other
parallelism, verify on load, and crash consistency.

Each launch is a real ``torchrun --nproc-per-node 2`` job on gloo with a tiny GPT
(2 layers, hidden 64, sequence 32, vocabulary 256) and dropout on, so a resume is exact
only if model, optimizer, every RNG state and the data position all come back. Starting
a job costs seconds, so each parallel layout is saved once (``LAYOUTS``) and its
checkpoints feed several checks; the layouts resumed in another layout turn dropout off
(see ``NO_DROPOUT``). The kill and SIGTERM tests check exact resume too: their reruns
reproduce the interrupted run's losses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_async.checkpoint_dirs import is_complete_checkpoint, read_tracker

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


def launch_pretrain(flags, metrics_file, env=None):
    """Run one job to its end, whatever its exit code; return the finished process."""
    return subprocess.run(
        _command([*flags, "--metrics-file", str(metrics_file)]),
        cwd=REPO, env=_env(env), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
    )


def run_pretrain(flags, metrics_file, env=None):
    """Run one job to completion; return its metrics (rank 0's JSON lines)."""
    proc = launch_pretrain(flags, metrics_file, env)
    if proc.returncode != 0:
        raise AssertionError(
            f"pretrain_gpt.py exited with {proc.returncode}\n--- stdout ---\n"
            f"{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return read_metrics(metrics_file)


def start_job_with_stalled_save(flags, metrics_file, log_path, env=None):
    """Start a job whose async save of iteration 4 stays in flight for 600 s; return it
    once the save of 2 is committed and training went on to iteration 5."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _command([*flags, "--metrics-file", str(metrics_file)]),
            cwd=REPO, env=_env({"PRETRAIN_GPT_DEBUG_SAVE_DELAY": "4:600", **(env or {})}),
            stdout=log, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while True:
        metrics = read_metrics(metrics_file)
        if events(metrics, "save") and max(losses(metrics), default=0) >= 5:
            return proc
        if proc.poll() is not None:
            raise AssertionError(f"job ended early:\n{log_path.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            kill_job(proc)
            raise AssertionError("the job did not commit iteration 2 and reach 5 in time")
        time.sleep(0.2)


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
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
"""Flags of the layouts that are resumed in another layout: without dropout and with the
same global batch, a run in another parallel layout computes the same function of the
same samples, so a resumed run's losses differ from the original run's only by
floating-point summation order (and the RNG states, which a layout change cannot load,
draw nothing)."""
RESHARD_RTOL = 1e-5
"""Relative tolerance on the resumed losses in another layout. Splitting matmuls over
tensor-parallel ranks and summing gradients over other ranks reorders fp32 sums: measured
here, the first three resumed losses agree with the original run's to at most 2e-7
(relative) after TP 2 -> 1, TP1xDP2 -> TP2xDP1 and PP 2 -> 1. Losing the optimizer state
instead (--no-load-optim) moves the second resumed loss by about 1e-3. 1e-5 sits well
between the two."""
RESHARDABLE = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable",
               "--async-save", "--use-persistent-ckpt-worker", "--ckpt-assume-constant-structure"]

LAYOUTS = {
    # Dropout on (exact resume needs every RNG state back), sync saves, the distributed
    # optimizer in its default bucket format, 4 micro-batches per step.
    "sync-tp2-distopt-accumulation": (
        ["--use-distributed-optimizer", "--global-batch-size", "8"],
        ["--tensor-model-parallel-size", "2"], 2),
    # Persistent worker, optimizer saved fully reshardable: resumed in other layouts.
    "persistent-tp2-reshardable": (
        [*NO_DROPOUT, *RESHARDABLE, "--global-batch-size", "4"],
        ["--tensor-model-parallel-size", "2"], 3),
    "persistent-pp2-reshardable-1f1b": (
        [*NO_DROPOUT, *RESHARDABLE, "--global-batch-size", "8"],
        ["--pipeline-model-parallel-size", "2"], 2),
}
"""One saved run per parallel layout: ``name: (flags, layout flags, K)``; the run trains
K*N iterations, saving every N. Its checkpoints feed the resume, reshard, verify and
load-refusal tests below."""

_saved_runs = {}


def saved_run(layout, tmp_path_factory):
    """``(save directory, metrics)`` of ``layout``'s one saved run in this session."""
    if layout not in _saved_runs:
        flags, layout_flags, rounds = LAYOUTS[layout]
        tmp = tmp_path_factory.mktemp(layout)
        metrics = run_pretrain([*flags, *layout_flags, "--train-iters", str(rounds * N), "--save", str(tmp / "a"),
                                "--save-interval", str(N)], tmp / "saved.jsonl")
        assert sorted(losses(metrics)) == list(range(1, rounds * N + 1))
        assert [e["iteration"] for e in events(metrics, "save")] == [N * (k + 1) for k in range(rounds)]
        assert read_tracker(str(tmp / "a")) == rounds * N
        _saved_runs[layout] = (tmp / "a", metrics)
    return _saved_runs[layout]


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("layout", ["sync-tp2-distopt-accumulation", "persistent-pp2-reshardable-1f1b"])
def test_resume_reproduces_the_uninterrupted_losses(tmp_path, tmp_path_factory, layout):
    """A new job resumes from the saved run's checkpoint at N (its checksums verified
    first) in the same layout and trains N more: its losses are bit-identical to the
    saved run's."""
    flags, layout_flags, _ = LAYOUTS[layout]
    saved, straight = saved_run(layout, tmp_path_factory)
    resumed = run_pretrain(
        [*flags, *layout_flags, "--train-iters", str(2 * N), "--load", str(saved),
         "--ckpt-step", str(N), "--ckpt-verify-on-load", "--save", str(tmp_path / "b"), "--save-interval", str(N)],
        tmp_path / "resumed.jsonl",
    )
    assert [e["iteration"] for e in events(resumed, "resume")] == [N]
    expected = {i: loss for i, loss in losses(straight).items() if N < i <= 2 * N}
    assert losses(resumed) == expected
    assert read_tracker(str(tmp_path / "b")) == 2 * N


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)
def test_verify_on_load_stops_on_a_damaged_file(tmp_path, tmp_path_factory):
    """One flipped byte in a ``.distcp`` file of the checkpoint to resume from (a copy of
    a saved run's): with ``--ckpt-verify-on-load`` the job stops before training and
    names that file."""
    flags, layout_flags, _ = LAYOUTS["sync-tp2-distopt-accumulation"]
    saved, _ = saved_run("sync-tp2-distopt-accumulation", tmp_path_factory)
    save_dir = tmp_path / "ckpt"
    shutil.copytree(saved, save_dir)
    damaged = sorted((save_dir / f"iter_{N:07d}").glob("*.distcp"))[0]
    with open(damaged, "r+b") as f:
        f.seek(damaged.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))

    resumed_metrics = tmp_path / "resumed.jsonl"
    proc = launch_pretrain([*flags, *layout_flags, "--train-iters", str(2 * N), "--load", str(save_dir),
                            "--ckpt-step", str(N), "--ckpt-verify-on-load"], resumed_metrics)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-6000:]
    assert "is damaged" in output and damaged.name in output, output[-6000:]
    assert not events(read_metrics(resumed_metrics), "resume")
    assert not losses(read_metrics(resumed_metrics))


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)
def test_bucket_format_with_other_tensor_parallelism_stops_before_loading(tmp_path, tmp_path_factory):
    """The distributed optimizer saved in its default bucket format (dp_reshardable) with
    TP 2 cannot load with TP 1: the job stops before reading any shard (no megatron-core
    shape mismatch) with a message naming both ways out."""
    saved, _ = saved_run("sync-tp2-distopt-accumulation", tmp_path_factory)
    resumed_metrics = tmp_path / "resumed.jsonl"
    proc = launch_pretrain(["--use-distributed-optimizer", "--tensor-model-parallel-size", "1",
                            "--global-batch-size", "8", "--train-iters", str(4 * N),
                            "--load", str(saved), "--no-load-rng"], resumed_metrics)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-6000:]
    assert "'dp_reshardable' format" in output, output[-6000:]
    assert "tensor-parallel size 2 -> 1" in output, output[-6000:]
    assert "--dist-ckpt-optim-fully-reshardable" in output and "--no-load-optim" in output
    assert "shape mismatch" not in output.lower(), output[-6000:]
    assert not events(read_metrics(resumed_metrics), "resume")
    assert not losses(read_metrics(resumed_metrics))


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)
def test_kill_during_async_save_resumes_from_last_complete_checkpoint(tmp_path):
    """SIGKILL every process of the job while the save of iteration 4 is still being
    written: the tracker keeps pointing at 2, iteration 4 is incomplete, and the next run
    resumes from 2 and reproduces the killed run's losses bit for bit (dropout on: every
    RNG state comes back). Forked writers, the distributed optimizer, fully parallel
    save."""
    save_dir = tmp_path / "ckpt"
    flags = ["--async-save", "--use-distributed-optimizer", "--ckpt-fully-parallel-save",
             "--train-iters", "8", "--save", str(save_dir), "--load", str(save_dir),
             "--save-interval", "2"]
    killed_metrics = tmp_path / "killed.jsonl"
    proc = start_job_with_stalled_save(flags, killed_metrics, tmp_path / "killed.log")
    kill_job(proc)

    killed = read_metrics(killed_metrics)
    assert [e["iteration"] for e in events(killed, "save")] == [2]
    assert read_tracker(str(save_dir)) == 2
    assert not is_complete_checkpoint(str(save_dir / "iter_0000004"))

    rerun = run_pretrain(flags, tmp_path / "rerun.jsonl")
    assert [e["iteration"] for e in events(rerun, "resume")] == [2]
    overlap = {i: loss for i, loss in losses(killed).items() if i > 2}
    assert len(overlap) >= 3, overlap
    assert {i: losses(rerun)[i] for i in overlap} == overlap
    assert read_tracker(str(save_dir)) == 8
    assert is_complete_checkpoint(str(save_dir / "iter_0000004"))


RESHARD_HOPS = {
    # TP2xDP1 -> TP1xDP2 from the checkpoint at N, then that run's own checkpoint at 2N
    # (saved in TP1xDP2) -> TP2xDP1 again.
    "tp2-to-tp1-to-tp2": ("persistent-tp2-reshardable", [
        ["--tensor-model-parallel-size", "1"], ["--tensor-model-parallel-size", "2"]]),
    "pp2-to-pp1": ("persistent-pp2-reshardable-1f1b", [["--pipeline-model-parallel-size", "1"]]),
}


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("case", sorted(RESHARD_HOPS))
def test_resume_with_other_parallelism_continues_the_losses(tmp_path, tmp_path_factory, case):
    """Resume the saved run (distributed optimizer saved fully reshardable, persistent
    worker) from N in another parallel layout for N iterations; each hop resumes from
    the previous hop's own checkpoint in the next layout. Every hop starts where it
    should and its losses match the saved run's within RESHARD_RTOL. The first loss of a
    hop is computed before any update (it checks the model); the later ones check the
    optimizer state (Adam's moments and step)."""
    layout, hops = RESHARD_HOPS[case]
    saved, original = saved_run(layout, tmp_path_factory)
    flags = LAYOUTS[layout][0]
    load_dir, start = saved, N
    for hop, resumed_layout in enumerate(hops):
        save_dir = tmp_path / f"hop{hop}"
        resumed = run_pretrain(
            [*flags, *resumed_layout, "--train-iters", str(start + N), "--save-interval", str(N),
             "--load", str(load_dir), "--ckpt-step", str(start), "--no-load-rng",
             "--save", str(save_dir)],
            tmp_path / f"hop{hop}.jsonl",
        )
        assert [e["iteration"] for e in events(resumed, "resume")] == [start], hop
        resumed_losses = losses(resumed)
        assert sorted(resumed_losses) == list(range(start + 1, start + N + 1)), hop
        for i, loss in sorted(resumed_losses.items()):
            assert loss == pytest.approx(losses(original)[i], rel=RESHARD_RTOL), (
                f"hop {hop}, iteration {i}: resumed {loss!r}, original {losses(original)[i]!r}")
        # The resharded run saves in its own layout; the next hop loads that checkpoint.
        assert [e["iteration"] for e in events(resumed, "save")] == [start + N], hop
        load_dir, start = save_dir, start + N


JOB_MARKER_ENV = "PRETRAIN_GPT_TEST_JOB"
"""Set on the torchrun command; every process of the job inherits it (ranks, persistent
workers, forked writers, multiprocessing's helpers), whatever its command line."""
SIGTERM_EXIT_S = 20
"""Under torchrun's 30 s grace before it SIGKILLs the ranks: a rank that ignores or
delays SIGTERM fails the test instead of being cleaned up by the escalation."""
CALLER_KINDS = {
    "temporal": ["--async-save"],
    "persistent": ["--async-save", "--use-persistent-ckpt-worker", "--use-distributed-optimizer",
                   "--ckpt-assume-constant-structure", "--ckpt-overlap-staging"],
}


def marked_processes(marker):
    """Every live process whose environment carries ``JOB_MARKER_ENV=marker``."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(JOB_MARKER_ENV) == marker:
                found.append(process)
        except psutil.Error:  # gone, a zombie, or not ours to read
            pass
    return found


def describe(processes):
    lines = []
    for p in processes:
        try:
            lines.append(f"pid {p.pid} (parent {p.ppid()}, {p.status()}): "
                         f"{' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            lines.append(f"pid {p.pid} (gone)")
    return "\n".join(lines)


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + SIGTERM_EXIT_S + 30)
@pytest.mark.parametrize("caller", sorted(CALLER_KINDS))
def test_sigterm_during_async_save_leaves_no_process_and_resumes(tmp_path, caller):
    """SIGTERM to torchrun (which forwards it to the ranks) while the save of iteration
    4 is being written: the whole job is gone within a bound, no background process
    outlives it, iteration 4 stays incomplete and the next run resumes from 2 and
    reproduces the terminated run's losses bit for bit (the persistent case with the
    distributed optimizer, cached plans and overlapped staging)."""
    save_dir = tmp_path / "ckpt"
    flags = [*CALLER_KINDS[caller], "--train-iters", "8", "--save", str(save_dir),
             "--load", str(save_dir), "--save-interval", "2"]
    marker = str(tmp_path)
    log_path = tmp_path / "terminated.log"
    proc = start_job_with_stalled_save(flags, tmp_path / "terminated.jsonl", log_path,
                                       env={JOB_MARKER_ENV: marker})
    try:
        job = marked_processes(marker)
        job_before = describe(job)
        background = [p for p in job if proc.pid not in (p.pid, p.ppid())]
        assert background, f"no background writer or worker found:\n{job_before}"
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + SIGTERM_EXIT_S
        try:
            proc.wait(timeout=SIGTERM_EXIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"torchrun still runs {SIGTERM_EXIT_S} s after SIGTERM; the job:\n"
                f"{describe(marked_processes(marker))}\n{log_path.read_text()[-6000:]}"
            ) from None
        # Polled afresh: a writer forked after the snapshot above counts too.
        while (left := marked_processes(marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, (
            f"left behind {SIGTERM_EXIT_S} s after SIGTERM:\n{describe(left)}\n"
            f"job before SIGTERM:\n{job_before}\n{log_path.read_text()[-6000:]}"
        )
    finally:
        if proc.poll() is None:
            kill_job(proc)
        for leftover in marked_processes(marker):
            leftover.kill()

    assert read_tracker(str(save_dir)) == 2
    in_flight = save_dir / "iter_0000004"
    assert not is_complete_checkpoint(str(in_flight))
    assert not (in_flight / "metadata.json").exists()
    assert not (in_flight / ".metadata").exists()

    rerun = run_pretrain(flags, tmp_path / "rerun.jsonl")
    assert [e["iteration"] for e in events(rerun, "resume")] == [2]
    terminated = losses(read_metrics(tmp_path / "terminated.jsonl"))
    overlap = {i: loss for i, loss in terminated.items() if i > 2}
    assert len(overlap) >= 3, overlap
    assert {i: losses(rerun)[i] for i in overlap} == overlap
    assert read_tracker(str(save_dir)) == 8
