"""The README's main command: a 2-rank GPT run with async saves, then a resume."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_async import cli

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_trains_saves_resumes_and_leaves_intact_checkpoints(tmp_path, capsys):
    ckpt_dir = tmp_path / "ckpt"
    proc = subprocess.run(
        ["bash", "examples/run_demo.sh", str(ckpt_dir)],
        cwd=REPO_ROOT, env=dict(os.environ, NPROC="2"), capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "iter_0000030" in proc.stdout
    assert (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "50"
    assert sorted(p.name for p in ckpt_dir.glob("iter_*")) == ["iter_0000040", "iter_0000050"]
    assert cli.main(["verify", str(ckpt_dir / "iter_0000050")]) == 0
    assert "INTACT" in capsys.readouterr().out
