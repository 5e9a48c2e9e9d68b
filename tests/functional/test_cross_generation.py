"""Checkpoints written under one megatron-core generation and loaded under the other.

Needs a second interpreter with the other generation installed, named by
``MEGATRON_ASYNC_OTHER_GENERATION_PYTHON`` (``.ci/run`` sets it to the 0.19.x test
environment's python); skipped without it.

What megatron-core allows: 0.17+ loads 0.16.x checkpoints (it still reads ``common.pt``);
0.16.x cannot load 0.17+ checkpoints through ``dist_checkpointing.load``, because it needs
``common.pt`` and 0.17+ keeps the common state inside the DCP files (0.16.1 fails while
looking for it, with an ``AttributeError`` from its common-state loader). Plain DCP loads
both.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_async.mcore import generation

OTHER_PYTHON = os.environ.get("MEGATRON_ASYNC_OTHER_GENERATION_PYTHON")
REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not OTHER_PYTHON,
        reason="MEGATRON_ASYNC_OTHER_GENERATION_PYTHON names no interpreter of the other "
        "megatron-core generation (.ci/run sets it)",
    ),
]


def _run(python: str, mode: str, path: Path) -> list:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [python, "-m", "tests.functional.scenarios_cross_generation", mode, str(path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("direction", ["here_to_other", "other_to_here"])
def test_checkpoints_cross_generations(tmp_path, direction):
    writer, reader = (sys.executable, OTHER_PYTHON)
    if direction == "other_to_here":
        writer, reader = reader, writer
    path = tmp_path / "ckpt"
    path.mkdir()
    written = _run(writer, "save", path)
    found = _run(reader, "load", path)
    wrote, read = written[0]["generation"], found[0]["generation"]
    assert wrote != read, (wrote, read)
    for rank_found in found:
        assert rank_found["dcp"] == "equal", rank_found
        if wrote == "registry":  # 0.16.x -> 0.17+: megatron-core reads common.pt
            assert rank_found["megatron"] == "equal", rank_found
        else:  # 0.17+ -> 0.16.x: no common.pt, which 0.16.x's loader needs: it must fail
            # loudly (it does, inside megatron-core), never return a wrong state.
            assert rank_found["megatron"] != "equal", rank_found
            assert not rank_found["megatron"].startswith("AssertionError"), rank_found
