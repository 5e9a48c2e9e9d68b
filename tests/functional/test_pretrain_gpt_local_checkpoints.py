"""Local checkpoints in the GPT example: a job of two "nodes" loses one and resumes from
the replicas its peers kept, or from the persistent checkpoint when that one is newer.

Each job is two ``torchrun --nnodes 2 --nproc-per-node 2`` launches on loopback, each
"node" with its own ``--non-persistent-local-ckpt-dir``, and the persistent checkpoints in
one shared directory. Replication with J = 2, F = 2 makes the cliques (0, 2) and (1, 3):
every part of node 1 (ranks 2 and 3) has a replica on node 0. Persistent checkpoints are
saved every 6 iterations and local ones every 2 in between (async, through the same
queue; both of Megatron-LM's algos). One job dies right after the local save of 10
(``PRETRAIN_GPT_DEBUG_CRASH_AFTER``), when the newest persistent checkpoint is 6; a
restart of it saves the persistent checkpoint of 12, and node 1 is killed while the local
save of 14 is being replicated (``PRETRAIN_GPT_DEBUG_HOLD_WRITE``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from megatron_async.checkpoint_dirs import read_tracker
from megatron_async.local.parts import part_name, record_name
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

TRAIN_ITERS = 16
CRASH_AFTER = 10
LAST_PERSISTENT = 6
NEXT_PERSISTENT = 12
KILLED_LOCAL = 14
"""The local save during whose replication node 1 is killed."""
SURVIVOR_BOUND_S = 90.0
"""How long node 0 may run on once node 1 is killed: far below the replication's own bound
(the queue's coordination timeout, 600 s), so a survivor that waits for it fails here."""
FLAGS = [
    *TINY_MODEL, "--train-iters", str(TRAIN_ITERS), "--async-save",
    "--ckpt-assume-constant-structure",  # local saves reuse megatron-core's distribution
    "--save-interval", str(LAST_PERSISTENT), "--non-persistent-save-interval", "2",
    "--non-persistent-ckpt-type", "local", "--replication", "--replication-jump", "2", "--replication-factor", "2",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_two_nodes(root, algo, env=None):
    """Start one job of two 2-rank "nodes" (persistent checkpoints in ``root/persistent``,
    node N's local ones in ``root/nodeN``); return each node's process and output file."""
    port = str(_free_port())
    launched = []
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
        # A file, not a pipe: nobody reads while the test watches the job.
        output = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(
            command, cwd=REPO, env=_env(env), stdout=output, stderr=subprocess.STDOUT, text=True,
        )
        launched.append((proc, output))
    return launched


def finish(launched, timeout_s=LAUNCH_TIMEOUT_S):
    """Wait for every node, killing what is left after ``timeout_s`` (its status is then
    -9); return each node's exit status and output."""
    deadline = time.monotonic() + timeout_s
    try:
        for proc, _ in launched:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        pass  # killed below; the caller's checks report it with the output
    finally:
        for proc, _ in launched:
            if proc.poll() is None:
                kill_node(proc)
    results = []
    for proc, output in launched:
        output.seek(0)
        results.append((proc.returncode, output.read()))
        output.close()
    return results


def run_two_nodes(root, algo, env=None):
    """Run one job of two nodes to its end; return each node's exit status and output."""
    return finish(launch_two_nodes(root, algo, env))


def kill_node(proc):
    """Lose a node: SIGKILL its torchrun agent and every process under it (its ranks, in
    sessions of their own, and their background writers) at once, as a power loss does."""
    try:
        agent = psutil.Process(proc.pid)
        doomed = [agent, *agent.children(recursive=True)]
    except psutil.NoSuchProcess:
        doomed = []
    for process in doomed:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


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
        # 16 saves locally in the loop and persistently at the end, as in Megatron-LM.
        assert [e["iteration"] for e in events(metrics, "local_save")] == [2, 4, 8, 10, 14, 16]
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
    # atomic with node 1 lost: test_a_node_killed_mid_replication_... below, which goes on.
    ("atomic", "one byte of a part flipped"),
    ("fully_parallel", "node 1 lost"),
])
def test_every_rank_resumes_from_the_newest_intact_local_checkpoint(
    tmp_path, tmp_path_factory, algo, damage
):
    """After the crash, node 1's local directory is lost (or rank 2's own part is damaged):
    every rank resumes from the local checkpoint of 10, newer than the persistent one of
    6, with node 1's parts taken from node 0's verified replicas, and the losses of 11 to
    16 equal the uninterrupted run's. With fully_parallel each data-parallel rank saved
    only its share, so the load also exchanges the shares between ranks."""
    straight = straight_run(tmp_path_factory)
    root = tmp_path / "job"
    shutil.copytree(crashed_run(tmp_path_factory, algo), root)
    os.remove(root / "metrics.jsonl")
    damage_fn, logged = DAMAGE[damage]
    damage_fn(root)

    results = run_two_nodes(root, algo)
    _check_finished(results)
    _assert_every_rank_resumed_from_local_10(results)
    if logged is not None:
        assert logged in results[1][1], results[1][1][-6000:]
    metrics = read_metrics(root / "metrics.jsonl")
    resumes = events(metrics, "resume")
    assert [(e["iteration"], e["tier"]) for e in resumes] == [(CRASH_AFTER, "local")]
    expected = {i: loss for i, loss in straight.items() if i > CRASH_AFTER}
    assert losses(metrics) == expected
    assert read_tracker(str(root / "persistent")) == TRAIN_ITERS


def _assert_every_rank_resumed_from_local_10(results):
    """Every rank logs that it resumed from the local checkpoint of 10 (persistent: 6)."""
    line = (f"[ckpt] resumed from the local checkpoint of iteration {CRASH_AFTER} (every part "
            f"verified against its digest; persistent checkpoint: iteration {LAST_PERSISTENT})")
    node0, node1 = results[0][1], results[1][1]
    assert line in node0 and f"[rank 1] {line}" in node0, node0[-6000:]
    assert f"[rank 2] {line}" in node1 and f"[rank 3] {line}" in node1, node1[-6000:]


def _wait_for(condition, launched, what, timeout_s=LAUNCH_TIMEOUT_S):
    """Poll ``condition`` while both nodes run; fail with their output if either ends first
    or it does not come within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        ended = any(proc.poll() is not None for proc, _ in launched)
        if ended or time.monotonic() > deadline:
            results = finish(launched, timeout_s=0)
            pytest.fail(f"{'a node ended' if ended else 'timed out'} before {what}:\n"
                        + "\n".join(out[-4000:] for _, out in results))
        time.sleep(0.05)


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S + 60)
def test_a_node_killed_mid_replication_leaves_no_partial_checkpoint_and_newer_persistent_wins(
    tmp_path, tmp_path_factory
):
    """Node 1 is lost, then, once replaced, killed while a local save is being replicated;
    by then the persistent checkpoint is newer than the newest complete local one.

    After the crash after 10, node 1's local directory is lost (atomic): every rank
    resumes from the local checkpoint of 10 with node 1's parts taken from node 0's
    replicas, and the losses from 11 on equal the uninterrupted run's. The job saves the
    persistent checkpoint of 12 and starts the local save of 14: rank 3's writer holds
    before writing its part, while rank 1's writer has started its own and waits for
    rank 3 to connect (its part streams to rank 3 as it is written, so it cannot finish
    without it). Node 1 is killed then (its torchrun agent and every
    process under it, SIGKILL). Node 0's ranks do not hang: the job ends there within
    ``SURVIVOR_BOUND_S``, the save of 14 is never reported durable and the tracker stays
    at 12. Rank 3's part of 14 exists nowhere, nor a record of rank 1's, so 14 is partial. Restarting both nodes,
    every rank finds the local checkpoint of 10 as the newest complete one, says that it
    is older than the persistent checkpoint of 12, resumes from that one, and the losses
    of 13 to 16 equal the uninterrupted run's.
    """
    straight = straight_run(tmp_path_factory)
    root = tmp_path / "job"
    shutil.copytree(crashed_run(tmp_path_factory, "atomic"), root)
    os.remove(root / "metrics.jsonl")
    _lose_node_1(root)
    marker = tmp_path / "rank-3-holds"
    rank_1_part = root / "node0" / "1" / part_name(KILLED_LOCAL, 1, dirty=True)
    launched = launch_two_nodes(
        root, "atomic", {"PRETRAIN_GPT_DEBUG_HOLD_WRITE": f"{KILLED_LOCAL}:3:{marker}"}
    )
    _wait_for(
        lambda: (marker.exists() and rank_1_part.exists()
                 and read_tracker(str(root / "persistent")) == NEXT_PERSISTENT),
        launched, f"rank 3's writer held the local save of {KILLED_LOCAL}, rank 1 started "
        f"its part and the persistent checkpoint of {NEXT_PERSISTENT} was durable",
    )
    kill_node(launched[1][0])
    killed_at = time.monotonic()
    results = finish(launched, timeout_s=SURVIVOR_BOUND_S)
    survived_s = time.monotonic() - killed_at
    node0_code, node0 = results[0]
    assert survived_s < SURVIVOR_BOUND_S, f"node 0 ran on {survived_s:.0f} s:\n{node0[-6000:]}"
    assert node0_code != 0, node0[-6000:]
    _assert_every_rank_resumed_from_local_10(results)
    metrics = read_metrics(root / "metrics.jsonl")
    resumes = events(metrics, "resume")
    assert [(e["iteration"], e["tier"]) for e in resumes] == [(CRASH_AFTER, "local")]
    trained = losses(metrics)
    assert min(trained) == CRASH_AFTER + 1 and KILLED_LOCAL in trained, trained
    assert trained == {i: straight[i] for i in trained}
    assert [e["iteration"] for e in events(metrics, "save")] == [NEXT_PERSISTENT]
    assert events(metrics, "local_save") == [], node0[-6000:]
    assert read_tracker(str(root / "persistent")) == NEXT_PERSISTENT
    assert not list(root.glob(f"node*/*/iter_{KILLED_LOCAL:07d}_3_local*")), results[1][1][-6000:]
    assert not (root / "node0" / "1" / record_name(KILLED_LOCAL, 1)).exists()

    os.remove(root / "metrics.jsonl")
    results = run_two_nodes(root, "atomic")
    _check_finished(results)
    node0, node1 = results[0][1], results[1][1]
    line = f"[ckpt] resumed from the persistent checkpoint of iteration {NEXT_PERSISTENT}: "
    why = (f"WARNING gpt.checkpointing: the local checkpoint of iteration {CRASH_AFTER} is "
           f"older than the persistent one of iteration {NEXT_PERSISTENT}: resuming from the "
           "persistent")
    for rank, out in ((0, node0), (1, node0), (2, node1), (3, node1)):
        assert f"[rank {rank}] {why}" in out, out[-6000:]
        assert (line in out) if rank == 0 else (f"[rank {rank}] {line}" in out), out[-6000:]
    metrics = read_metrics(root / "metrics.jsonl")
    resumes = events(metrics, "resume")
    assert [(e["iteration"], e["tier"]) for e in resumes] == [(NEXT_PERSISTENT, "persistent")]
    assert losses(metrics) == {i: loss for i, loss in straight.items() if i > NEXT_PERSISTENT}
    assert read_tracker(str(root / "persistent")) == TRAIN_ITERS
