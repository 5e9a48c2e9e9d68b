"""The profiling tools behind docs/benchmarks.md run end to end at tiny sizes.

Only the shape of their output is checked: timings belong in the benchmark, never in tests.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[3]


def _run(*command, timeout=150):
    proc = subprocess.run([sys.executable, *command], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(120)
def test_direct_write_cpu_checks_its_files_and_prints_medians(tmp_path, capsys):
    from tools.bench.micro import direct_write_cpu

    out = {"shared": _run("-m", "tools.bench.micro.direct_write_cpu", "--dir", str(tmp_path),
                          "--mib", "3", "--reps", "2", "--source", "shared")}
    # Private memory needs no shared-memory segment: this process can run it.
    direct_write_cpu.main(["--dir", str(tmp_path), "--mib", "3", "--reps", "2", "--source", "private"])
    out["private"] = capsys.readouterr().out
    for source, text in out.items():
        assert re.search(rf"3 MiB from {source} memory, (direct I/O|buffered .*), median of 2: "
                         r"user \d+ ms, system \d+ ms, wall \d+ ms", text), text
    assert not list(tmp_path.iterdir())  # every file was checked, then removed


@pytest.mark.timeout(180)
def test_save_profile_profiles_the_last_save_and_its_finalize():
    out = _run("-m", "tools.bench.micro.save_profile", "--method", "ours_persistent",
               "--hidden-size", "64", "--num-layers", "1", "--saves", "2", "--lines", "5")
    assert re.search(r"ours_persistent, GPT 1 x 64, 1 rank: stalls \(ms\) \[[\d.]+, [\d.]+\]", out), out
    stall, finalize = out.split("== its finalize")
    assert "checkpointing.py" in stall and "(save)" in stall
    assert "maybe_finalize" in finalize


@pytest.mark.timeout(180)
def test_warm_stall_times_both_callers_their_phases_and_a_profile():
    out = _run("-m", "tools.bench.micro.warm_stall", "--tensors", "20", "--tensor-bytes", "1KiB",
               "--saves", "3", "--phases", "--profile", "--lines", "5")
    assert re.search(r"20 tensors x 1024 B = [\d.]+ MiB, 1 rank; one memory copy [\d.]+ ms", out), out
    for caller in ("persistent", "temporal"):
        assert re.search(rf"{caller}: warm stall median [\d.]+ ms = [\d.]+ x memcpy .* 2 saves "
                         r"reused the plan", out), out
        assert f"== {caller}: the last save's call, by own time ==" in out
    assert re.search(r"encoding the request \(persistent\) +[\d.]+ ms", out), out
    assert re.search(r"staging \(copy into shared memory\) +[\d.]+ ms", out), out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(180)
def test_warm_stall_of_device_tensors_times_the_three_device_to_host_copies():
    out = _run("-m", "tools.bench.micro.warm_stall", "--device", "cuda", "--tensors", "20",
               "--tensor-bytes", "1KiB", "--saves", "3", "--callers", "persistent", "--phases")
    assert re.search(r"20 tensors x 1024 B = [\d.]+ MiB, 1 rank; one device-to-host copy "
                     r"[\d.]+ ms", out), out
    for label in ("one flat copy", "one copy per tensor", r"device gather \+ one copy"):
        assert re.search(rf"device-to-host, {label}: [\d.]+ ms", out), out
    assert re.search(r"persistent: warm stall median .* 2 saves reused the plan", out), out
    assert re.search(r"staging \(copy into shared memory\) +[\d.]+ ms", out), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs the test above")
@pytest.mark.timeout(120)
def test_warm_stall_refuses_device_tensors_without_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "tools.bench.micro.warm_stall", "--device", "cuda"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2 and "sees no CUDA device" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.timeout(180)
def test_torch_save_budget_reports_each_budget_within_it(tmp_path):
    out = _run("-m", "tools.bench.micro.torch_save_budget", "--mib", "1", "--tensors", "8",
               "--saves", "2", "--dir", str(tmp_path))
    assert re.search(r"state 1048576 bytes in 8 tensors, fork per save", out), out
    assert re.search(r"sync torch.save: stall [\d.]+s", out), out
    for label, rounds in (("default", 1), ("1.00x", 1), ("0.50x", 2), ("0.25x", 4)):
        found = re.search(rf"budget {label}: stall [\d.]+s, written after [\d.]+s, peak staging "
                          rf"(\d+) bytes \([\d.]+x\), {rounds} round\(s\)", out)
        assert found, out
        limit = 2**20 * (1.0 if label == "default" else float(label[:-1]))
        assert int(found.group(1)) <= limit + 64 * 1024, out  # control blocks: a few KiB
