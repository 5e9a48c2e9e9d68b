"""Local checkpoints in the GPT example: a job of two "nodes" loses one and resumes from
the replicas its peers kept.

Each job is two ``torchrun --nnodes 2 --nproc-per-node 2`` launches on loopback, each
"node" with its own ``--non-persistent-local-ckpt-dir``, and the persistent checkpoints in
one shared directory. Replication with J = 2, F = 2 makes the cliques (0, 2) and (1, 3):
every part of node 1 (ranks 2 and 3) has a replica on node 0. Persistent checkpoints are
saved every 6 iterations and local ones every 2 in between (async, through the same
queue; both of Megatron-LM's algos); the job dies right after the local save of 10 (``PRETRAIN_GPT_DEBUG_CRASH_AFTER``),
when the newest persistent checkpoint is 6.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from megatron_async.checkpoint_dirs import read_tracker
from tests.functional.test_pretrain_gpt import (
    LAUNCH_TIMEOUT_S,
    REPO,
    SCRIPT,
    TINY_MODEL,
    _env,
    events,
    losses,
    read_metrics,
)

pytestmark = pytest.mark.slow

TRAIN_ITERS = 14
CRASH_AFTER = 10
LAST_PERSISTENT = 6
FLAGS = [
    *TINY_MODEL, "--train-iters", str(TRAIN_ITERS), "--async-save",
    "--save-interval", str(LAST_PERSISTENT), "--non-persistent-save-interval", "2",
    "--non-persistent-ckpt-type", "local", "--replication", "--replication-jump", "2", "--replication-factor", "2",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_nodes(root, algo, env=None):
    """Run one job of two 2-rank "nodes" (persistent checkpoints in ``root/persistent``,
    node N's local ones in ``root/nodeN``); return each node's exit status and output."""
    port = str(_free_port())
    procs = []
    for node in (0, 1):
        command = [
            "nice", "-n", "10", sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", port, SCRIPT, *FLAGS,
            "--save", str(root / "persistent"), "--load", str(root / "persistent"),
            "--non-persistent-local-ckpt-dir", str(root / f"node{node}"),
            "--non-persistent-local-ckpt-algo", algo,
            "--metrics-file", str(root / "metrics.jsonl"),  # written by rank 0 only
        ]
        procs.append(subprocess.Popen(
            command, cwd=REPO, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        ))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]


def _check_finished(results):
    for node, (returncode, out) in enumerate(results):
        assert returncode == 0, f"node {node} exited with {returncode}:\n{out[-6000:]}"


_runs = {}


def straight_run(tmp_path_factory):
    """Losses of the same job run uninterrupted to the end (once per session; local saves
    do not change them, whatever their algo)."""
    if "straight" not in _runs:
        root = tmp_path_factory.mktemp("straight")
        _check_finished(run_two_nodes(root, "atomic"))
        metrics = read_metrics(root / "metrics.jsonl")
        assert sorted(losses(metrics)) == list(range(1, TRAIN_ITERS + 1))
        # 14 saves locally in the loop and persistently at the end, as in Megatron-LM.
        assert [e["iteration"] for e in events(metrics, "local_save")] == [2, 4, 8, 10, 14]
        _runs["straight"] = losses(metrics)
    return _runs["straight"]


def crashed_run(tmp_path_factory, algo):
    """A job lost right after the local save of 10 (once per algo and session): its
    directories."""
    if algo not in _runs:
        root = tmp_path_factory.mktemp(f"crashed-{algo}")
        results = run_two_nodes(root, algo, {"PRETRAIN_GPT_DEBUG_CRASH_AFTER": str(CRASH_AFTER)})
        assert all(code != 0 for code, _ in results), results
        assert f"[debug] iter {CRASH_AFTER}: every rank exits now" in results[0][1], results[0][1][-6000:]
        assert read_tracker(str(root / "persistent")) == LAST_PERSISTENT
        metrics = read_metrics(root / "metrics.jsonl")
        assert [e["iteration"] for e in events(metrics, "local_save")] == [2, 4, 8, 10]
        _runs[algo] = root
    return _runs[algo]


def _lose_node_1(root):
    shutil.rmtree(root / "node1")


def _flip_one_byte_of_rank_2s_own_part(root):
    path = root / "node1" / "2" / f"iter_{CRASH_AFTER:07d}_2_local.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "node 1 lost": (_lose_node_1, None),
    "one byte of a part flipped": (_flip_one_byte_of_rank_2s_own_part, "(damaged): not used"),
}
"""``case: (what happens to the crashed job's directories, what node 1 logs about it)``."""


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("algo, damage", [
    ("atomic", "node 1 lost"),
    ("atomic", "one byte of a part flipped"),
    ("fully_parallel", "node 1 lost"),
])
def test_every_rank_resumes_from_the_newest_intact_local_checkpoint(
    tmp_path, tmp_path_factory, algo, damage
):
    """After the crash, node 1's local directory is lost (or rank 2's own part is damaged):
    every rank resumes from the local checkpoint of 10, newer than the persistent one of
    6, with node 1's parts taken from node 0's verified replicas, and the losses of 11 to
    14 equal the uninterrupted run's. With fully_parallel each data-parallel rank saved
    only its share, so the load also exchanges the shares between ranks."""
    straight = straight_run(tmp_path_factory)
    root = tmp_path / "job"
    shutil.copytree(crashed_run(tmp_path_factory, algo), root)
    os.remove(root / "metrics.jsonl")
    damage_fn, logged = DAMAGE[damage]
    damage_fn(root)

    results = run_two_nodes(root, algo)
    _check_finished(results)
    line = (f"[ckpt] resumed from the local checkpoint of iteration {CRASH_AFTER} (every part "
            f"verified against its digest; persistent checkpoint: iteration {LAST_PERSISTENT})")
    node0, node1 = results[0][1], results[1][1]
    assert line in node0 and f"[rank 1] {line}" in node0, node0[-6000:]
    assert f"[rank 2] {line}" in node1 and f"[rank 3] {line}" in node1, node1[-6000:]
    if logged is not None:
        assert logged in node1, node1[-6000:]
    metrics = read_metrics(root / "metrics.jsonl")
    resumes = events(metrics, "resume")
    assert [(e["iteration"], e["tier"]) for e in resumes] == [(CRASH_AFTER, "local")]
    expected = {i: loss for i, loss in straight.items() if i > CRASH_AFTER}
    assert losses(metrics) == expected
    assert read_tracker(str(root / "persistent")) == TRAIN_ITERS
