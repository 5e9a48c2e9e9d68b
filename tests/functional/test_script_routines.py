"""Save routines defined in an unguarded two-rank training script run in the background
with both callers (temporal, persistent) and every launcher."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.functional.harness import _free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("_script_routines.py")
WORLD_SIZE = 2
CALLERS = ("fork", "temporal")


def _launch(launch: str, out_dir: Path, timeout_s: float) -> None:
    """Run the script on two ranks the way ``launch`` says; fail with their output."""
    args = [str(out_dir), str(REPO_ROOT)]
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(WORLD_SIZE), OMP_NUM_THREADS="1")
    stdin = SCRIPT if launch == "stdin" else os.devnull  # a file: no rank waits for its input
    if launch == "torchrun":  # one launcher starts both ranks
        torchrun = ["-m", "torch.distributed.run", f"--nproc-per-node={WORLD_SIZE}"]
        ranks = [([*torchrun, f"--master-port={port}", str(SCRIPT), *args], env)]
    else:
        command = {"file": [str(SCRIPT)], "-c": ["-c", SCRIPT.read_text()], "stdin": ["-"]}[launch]
        ranks = [([*command, *args], dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(WORLD_SIZE)]
    procs, logs = [], []
    for index, (command, rank_env) in enumerate(ranks):
        logs.append(out_dir / f"launch{index}.log")
        with open(stdin) as stdin_file, open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, *command], stdin=stdin_file, stdout=log, stderr=subprocess.STDOUT,
                cwd=out_dir, env=rank_env,
            ))
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # reported below, with the output
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, f"exit code {proc.returncode}:\n{log.read_text()[-4000:]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launch", ["file", "-c", "stdin", "torchrun"])
def test_script_routines_run_in_the_background_with_every_caller(tmp_path, launch):
    _launch(launch, tmp_path, timeout_s=240)
    results = [json.loads((tmp_path / f"result-rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    trainer_pids = sorted(str(result["fork"]["trainer_pid"]) for result in results)
    # The script's top-level code ran once per rank: no worker ran it.
    assert sorted((tmp_path / "top_level_runs").read_text().split()) == trainer_pids
    for rank, result in enumerate(results):
        assert result["package_file"].startswith(str(REPO_ROOT))
        weights = [10.0 * rank + i for i in range(4)]
        for caller in CALLERS:
            trainer_pid, worker_pid = result[caller]["trainer_pid"], result[caller]["worker_pid"]
            function = json.loads((tmp_path / f"{caller}-function-rank{rank}.json").read_text())
            callable_ = json.loads((tmp_path / f"{caller}-callable-rank{rank}.json").read_text())
            # The routines ran on the staged snapshots, with the script's globals.
            assert function == {
                "routine": "write_marker", "note": f"{caller} rank {rank}", "staged": weights,
                "pid": function["pid"], "version": "v1",
            }
            assert callable_["routine"] == "CallableWriter" and callable_["version"] == "v1"
            assert callable_["staged"] == [2 * (w + 1000) for w in weights]
            # ... in the background: the persistent worker, or a process forked per save.
            for marker in (function, callable_):
                if caller == "temporal":
                    assert marker["pid"] != trainer_pid and worker_pid is None
                else:
                    assert marker["pid"] == worker_pid != trainer_pid
            for routine in ("function", "callable"):
                finalized = json.loads((tmp_path / f"{caller}-{routine}-rank{rank}.json.finalized").read_text())
                assert finalized["pid"] == trainer_pid
                assert len(finalized["peer_routines"]) == WORLD_SIZE
