"""The lost-time measurement runs end to end at a tiny size and reports what it promises.

Only the shape of the output is checked: timings belong in the benchmark, never in tests.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.tools.redo_report import assert_report_redone

REPO_ROOT = Path(__file__).resolve().parents[3]

_ENTRY_KEYS = {"method", "ranks", "hidden_size", "status", "num_bytes_per_rank", "memcpy_s",
               "free_iteration_s", "setup_s", "saves", "stall_first_s", "stall_warm_s",
               "lost_warm_s", "first_and_setup_s"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_lost_time_only_writes_tables_targets_and_plot(tmp_path):
    out = tmp_path / "bench"
    methods = "sync,ours_persistent_overlap,dcp_async_staging"
    command = [
        sys.executable, str(REPO_ROOT / "tools" / "benchmark.py"), "--lost-time-only",
        "--lost-time-ranks", "1", "--lost-time-hidden-sizes", "64", "--lost-time-layers", "2",
        "--lost-time-saves", "2", "--lost-time-window", "1", "--lost-time-methods", methods,
        "--out", str(out),
    ]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    lost = json.loads((out / "results.json").read_text())["lost_time"]
    entries = {e["method"]: e for e in lost["runs"]}
    assert set(entries) == set(methods.split(","))
    for entry in entries.values():
        assert entry["status"] == "ok", entry.get("reason")
        assert _ENTRY_KEYS <= set(entry)
        assert len(entry["saves"]) == 2
    targets = {(t["target"], t["method"]) for t in lost["targets"]}
    assert {("lost_vs_sync", "ours_persistent_overlap"),
            ("lost_vs_dcp_best", "ours_persistent_overlap"),
            ("first_vs_sync", "ours_persistent_overlap"),
            ("overlap_stall_vs_memcpy", "ours_persistent_overlap")} <= targets
    assert all(t["verdict"] in ("PASS", "MISS", "N/A") for t in lost["targets"])
    for plot in lost["plots"]:
        assert Path(plot).is_file() and Path(plot).stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "Training time lost per checkpoint" in report and "Lost-time targets" in report

    assert_report_redone(out, tmp_path)
