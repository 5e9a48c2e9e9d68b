"""``--ckpt-save-failure continue`` in the GPT example: failed saves do not end the job.

Real 2-rank torchrun jobs; the example's fault injection (``PRETRAIN_GPT_DEBUG_SAVE_FAULT``)
makes the background write of chosen iterations fail on rank 1: a full disk (ENOSPC) or a
writer process killed outright.
"""

from __future__ import annotations

import pytest

from megatron_async.checkpoint_dirs import is_complete_checkpoint, read_tracker
from tests.functional.test_pretrain_gpt import (
    LAUNCH_TIMEOUT_S,
    events,
    launch_pretrain,
    losses,
    read_metrics,
    run_pretrain,
)

pytestmark = pytest.mark.slow


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("caller", ["temporal", "persistent"])
def test_failed_saves_are_logged_and_training_goes_on(tmp_path, caller):
    """A full disk at iteration 4 and a killed writer at 6: the job trains to the end, the
    saves of 2, 8 and 10 commit, the tracker names 10, and 4 and 6 stay incomplete.

    With forked writers, the next run resumes from 10 and meets two full disks in a row
    (12 and 14) with a limit of 2: it stops with TooManySaveFailuresError, and the
    tracker still names the last complete checkpoint."""
    save_dir = tmp_path / "ckpt"
    flags = ["--async-save", "--save", str(save_dir), "--load", str(save_dir),
             "--save-interval", "2", "--ckpt-save-failure", "continue"]
    if caller == "persistent":
        flags.append("--use-persistent-ckpt-worker")
    faults = {"PRETRAIN_GPT_DEBUG_SAVE_FAULT": "4:disk_full,6:dead_worker"}
    metrics = run_pretrain([*flags, "--train-iters", "10"], tmp_path / "run.jsonl", faults)

    assert max(losses(metrics)) == 10
    assert [e["iteration"] for e in events(metrics, "save_failed")] == [4, 6]
    assert [e["iteration"] for e in events(metrics, "save")] == [2, 8, 10]
    assert read_tracker(str(save_dir)) == 10
    for iteration in (4, 6):
        assert not is_complete_checkpoint(str(save_dir / f"iter_{iteration:07d}"))
    if caller == "persistent":
        return

    proc = launch_pretrain([*flags, "--train-iters", "18", "--ckpt-max-consecutive-save-failures", "2"],
                           tmp_path / "resumed.jsonl",
                           {"PRETRAIN_GPT_DEBUG_SAVE_FAULT": "12:disk_full,14:disk_full"})
    resumed = read_metrics(tmp_path / "resumed.jsonl")
    assert [e["iteration"] for e in events(resumed, "resume")] == [10], proc.stderr[-6000:]
    assert proc.returncode != 0
    assert "TooManySaveFailuresError" in proc.stderr and "2 checkpoint saves failed in a row" in proc.stderr
    assert "No space left on device" in proc.stderr
    assert [e["iteration"] for e in events(resumed, "save_failed")] == [12]
    assert read_tracker(str(save_dir)) == 10
