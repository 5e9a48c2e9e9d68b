"""The benchmark runs end to end at minimal sizes and writes the results it promises: one
run measures the main table (synthetic workload) and the training time lost per
checkpoint (``--lost-time``).

Only the shape of the output is checked: timings belong in the benchmark, never in tests.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.tools.redo_report import assert_report_redone

REPO_ROOT = Path(__file__).resolve().parents[3]

_RUN_KEYS = {"variant", "workload", "ranks", "tensor_count", "status", "reason", "notes",
             "saves", "first", "warm", "num_bytes_per_rank"}
_SAVE_KEYS = {"stall_s", "plan_s", "stage_s", "write_s", "write_bytes_per_s", "finalize_s",
              "e2e_s", "e2e_bytes_per_s", "peak_rss", "peak_worker_rss", "held_total",
              "held_staging"}
_LOST_TIME_KEYS = {"method", "ranks", "hidden_size", "status", "num_bytes_per_rank", "memcpy_s",
                   "free_iteration_s", "setup_s", "saves", "stall_first_s", "stall_warm_s",
                   "lost_warm_s", "first_and_setup_s"}
_LOST_TIME_METHODS = "sync,ours_persistent_overlap,dcp_async_staging"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_benchmark_writes_results_table_lost_time_and_plots(tmp_path):
    out = tmp_path / "bench"
    command = [
        sys.executable, str(REPO_ROOT / "tools" / "benchmark.py"),
        "--ranks", "1", "--bytes-per-rank", "2MiB", "--tensor-counts", "4",
        "--saves", "2", "--memory-saves", "2", "--workloads", "synthetic",
        "--variants", "ours_temporal,ours_persistent,dcp_async_thread,mcore_async_temporal",
        "--scaling-ranks", "1", "--scaling-tensor-count", "4",
        "--lost-time", "--lost-time-ranks", "1", "--lost-time-hidden-sizes", "64",
        "--lost-time-layers", "2", "--lost-time-saves", "2", "--lost-time-window", "1",
        "--lost-time-methods", _LOST_TIME_METHODS, "--out", str(out),
    ]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((out / "results.json").read_text())
    assert {"command", "config", "host", "limits", "runs", "targets", "checksums", "gpt",
            "plots"} <= set(results)
    assert {"memcpy_single_bytes_per_s", "memcpy_concurrent_bytes_per_s",
            "disk_single_bytes_per_s", "disk_concurrent_bytes_per_s"} <= set(results["limits"])

    main_runs = {(r["variant"], r["tensor_count"]): r for r in results["runs"]
                 if r["sweep"] == "main"}
    for variant in ("ours_temporal", "ours_persistent", "dcp_async_thread"):
        for count in (4,):
            run = main_runs[(variant, count)]
            assert run["status"] == "ok", run["reason"]
            assert _RUN_KEYS <= set(run)
            assert len(run["saves"]) == 2
            assert _SAVE_KEYS <= set(run["first"])
    # megatron-core's own async save is reported, never silently dropped.
    mcore = main_runs[("mcore_async_temporal", 4)]
    assert mcore["status"] in ("ok", "unsupported")
    if mcore["status"] == "unsupported":
        assert mcore["reason"]

    targets = {(t["target"], t["variant"], t["tensor_count"]) for t in results["targets"]}
    for name in ("stall_vs_memcpy", "write_vs_disk", "stall_vs_dcp_async",
                 "plan_cached_vs_first", "memory_growth", "staging_held"):
        assert (name, "ours_persistent", 4) in targets
    assert all(t["verdict"] in ("PASS", "MISS", "N/A") for t in results["targets"])

    assert any(r["sweep"] == "ranks" for r in results["runs"])
    for plot in results["plots"]:
        assert Path(plot).is_file() and Path(plot).stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "Targets" in report and "Physical limits" in report

    lost = results["lost_time"]
    entries = {e["method"]: e for e in lost["runs"]}
    assert set(entries) == set(_LOST_TIME_METHODS.split(","))
    for entry in entries.values():
        assert entry["status"] == "ok", entry.get("reason")
        assert _LOST_TIME_KEYS <= set(entry)
        assert len(entry["saves"]) == 2
    lost_targets = {(t["target"], t["method"]) for t in lost["targets"]}
    assert {("lost_vs_sync", "ours_persistent_overlap"),
            ("lost_vs_dcp_best", "ours_persistent_overlap"),
            ("first_vs_sync", "ours_persistent_overlap"),
            ("overlap_stall_vs_memcpy", "ours_persistent_overlap")} <= lost_targets
    assert all(t["verdict"] in ("PASS", "MISS", "N/A") for t in lost["targets"])
    for plot in lost["plots"]:
        assert Path(plot).is_file() and Path(plot).stat().st_size > 0
    assert "Training time lost per checkpoint" in report and "Lost-time targets" in report

    # The tables and plots can be redone from results.json alone, measuring nothing.
    assert_report_redone(out, tmp_path)
