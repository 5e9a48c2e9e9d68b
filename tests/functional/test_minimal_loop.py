"""examples/minimal_loop.py at 2 ranks: saves at the right steps, resumes, fails early on a bad --save.

The save-and-resume case launches the example with ``torchrun`` as the README says; the
bad ``--save`` case starts the two ranks itself, so that each rank runs to its own end
(torchrun stops the other ranks as soon as one exits) and each rank's error can be read.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing

from megatron_async.checkpoint_dirs import list_checkpoints, read_tracker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "minimal_loop.py")
LAUNCH_TIMEOUT_S = 120


def _env(**extra):
    pythonpath = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath,
                **extra)


def run_example(*flags):
    """One ``torchrun --nproc-per-node 2`` launch to its end; its output (it must succeed)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         SCRIPT, *flags],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    return proc.stdout, proc.stderr


def test_the_example_saves_the_right_steps_and_resumes_from_the_latest(tmp_path):
    save = str(tmp_path / "not_yet" / "ckpt")  # created by the manager
    out, err = run_example("--save", save, "--train-iters", "6", "--save-interval", "4")
    assert "resumed" not in out
    assert [(c.iteration, c.complete) for c in list_checkpoints(save)] == [(4, True), (6, True)]
    assert read_tracker(save) == 6
    for iteration in (4, 6):  # the package's INFO lines show each save and its commit
        path = os.path.join(save, f"iter_{iteration:07d}")
        assert f"checkpoint {path} is complete; tracker updated" in err, err[-4000:]
        assert re.search(rf"rank 1: async call \d+ finalized \({re.escape(path)}\): stall", err), err[-4000:]

    out, err = run_example("--save", save, "--train-iters", "10", "--save-interval", "4")
    for rank in (0, 1):
        assert f"[rank {rank}] resumed from {save}/iter_0000006 at iteration 6" in out, out
    assert [c.iteration for c in list_checkpoints(save) if c.complete] == [4, 6, 8, 10]
    assert read_tracker(save) == 10

    last = os.path.join(save, "iter_0000010")
    assert dist_checkpointing.load_common_state_dict(last)["iteration"] == 10
    metadata = dcp.FileSystemReader(last).read_metadata()
    assert metadata.state_dict_metadata["model.fc1.weight"].size == (64, 8)  # both ranks' rows
    state = {"model.fc1.weight": torch.zeros(64, 8)}
    dcp.load(state, checkpoint_id=last, no_dist=True)
    assert state["model.fc1.weight"].abs().sum() > 0


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unwritable_save_fails_on_both_ranks_with_the_same_error_before_training(tmp_path):
    (tmp_path / "a_file").write_text("")
    save = str(tmp_path / "a_file" / "ckpt")  # under a regular file: root cannot write it either
    port = str(_free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, SCRIPT, "--save", save, "--train-iters", "4"], cwd=REPO,
            env=_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=LAUNCH_TIMEOUT_S) for proc in ranks]
    errors = []
    for proc, (out, err) in zip(ranks, outputs):
        assert proc.returncode != 0 and "iteration" not in out, (out, err[-4000:])
        # torch prefixes a rank's uncaught traceback with "[rankN]: "; the last error ended it.
        lines = [re.sub(r"^\[rank\d\]: ?", "", line) for line in err.strip().splitlines()]
        start = max(i for i, line in enumerate(lines) if line.startswith("megatron_async.errors."))
        errors.append("\n".join(lines[start:]))
    assert errors[0] == errors[1], errors
    assert errors[0].startswith(
        f"megatron_async.errors.CheckpointValidationError: checking the save directory {save} "
        "failed on 2 rank(s):"
    ), errors[0]
    for rank in (0, 1):
        assert f"rank {rank}: save directory {save} is not writable (NotADirectoryError" in errors[0]
