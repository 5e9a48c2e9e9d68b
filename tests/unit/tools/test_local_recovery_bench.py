"""The benchmark's local-recovery mode (``--local-recovery-only``).

Scenario: before choosing the local tier (F = 2), an operator measures on their machine how
long a restarted job takes to recover after losing a node, from the peers' replicas against
the persistent checkpoint, and how much host memory a replicated local save takes against
the staging budget. Only the shape of the output is checked: timings belong in the
benchmark, never in tests.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.tools.redo_report import assert_report_redone
from tools.bench.local_recovery_run import aggregate_local_recovery, local_recovery_options

REPO_ROOT = Path(__file__).resolve().parents[3]

_RECOVERY_KEYS = {"condition", "local_s", "local_find_latest_s", "local_load_s",
                  "persistent_load_s", "local_over_persistent"}
_MEMORY_KEYS = {"method", "budget_bytes", "staging_peak_bytes", "trainer_rss_growth_bytes",
                "writer_rss_growth_bytes", "staging_peak_over_budget",
                "trainer_rss_growth_over_budget", "writer_rss_growth_over_budget",
                "pss_after_bytes", "stall_s", "e2e_s"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_recovery_only_reports_recovery_and_memory_rows(tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, str(REPO_ROOT / "tools" / "benchmark.py"),
               "--local-recovery-only", "--ranks", "2", "--bytes-per-rank", "2MiB",
               "--local-recovery-tensors", "4", "--local-recovery-repeats", "1",
               "--launch-timeout-s", "240", "--out", str(out)]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    entry = json.loads((out / "results.json").read_text())["local_recovery"]
    assert entry["status"] == "ok", entry.get("reason")
    assert entry["num_bytes_per_rank"] == 2 * 2**20
    assert entry["evicted_files"] > 0  # the cold condition dropped the checkpoints' files
    rows = {row["condition"]: row for row in entry["recovery"]}
    assert set(rows) == {"warm", "cold"}
    for row in rows.values():
        assert _RECOVERY_KEYS <= set(row)
        assert row["local_s"] > 0 and row["persistent_load_s"] > 0
        assert row["local_over_persistent"] > 0
    memory = {row["method"]: row for row in entry["memory"]}
    assert set(memory) == {"ours_local_f2", "ours_persistent"}
    for row in memory.values():
        assert _MEMORY_KEYS <= set(row)
        assert row["budget_bytes"] == 2 * 2**20
        assert row["staging_peak_bytes"] > 0 and row["e2e_s"] > 0
    # A replicated local save of a state within the budget stages one copy of it.
    assert memory["ours_local_f2"]["staging_peak_over_budget"] >= 1.0

    report = (out / "report.md").read_text()
    assert "Recovery after a lost node" in report and "ours_local_f2" in report
    assert_report_redone(out, tmp_path)


def _options(ranks, **overrides):
    args = dict(ranks=ranks, local_recovery=False, local_recovery_only=True,
                local_recovery_tensors=4, local_recovery_repeats=1)
    return local_recovery_options(argparse.Namespace(**dict(args, **overrides)))


def test_an_odd_rank_count_is_refused_with_what_to_pass():
    with pytest.raises(ValueError, match="even --ranks"):
        _options(3)
    assert _options(4).mode == "only"
    assert _options(1, local_recovery_only=False).mode == "off"  # not asked: not checked


def _rank(local_s, persistent_s, staging):
    trials = {"local_s": local_s, "local_find_latest_s": local_s, "local_load_s": local_s,
              "persistent_load_s": persistent_s}
    record = {"budget_bytes": 100, "staging_peak_bytes": staging,
              "trainer_rss_growth_bytes": 50, "writer_rss_growth_bytes": 300,
              "pss_after_bytes": 1, "stall_s": 0.1, "e2e_s": 0.2}
    return {"num_bytes": 100, "recovery": {"warm": trials},
            "memory": [dict(record, method="ours_local_f2")]}


def test_each_trial_is_its_slowest_rank_and_memory_its_largest():
    entry = aggregate_local_recovery([_rank([1.0, 4.0, 2.0], [2.0, 2.0, 2.0], 100),
                                      _rank([3.0, 1.0, 1.0], [1.0, 1.0, 8.0], 150)])
    (row,) = entry["recovery"]
    assert row["local_s_trials"] == [3.0, 4.0, 2.0] and row["local_s"] == 3.0
    assert row["persistent_load_s"] == 2.0 and row["local_over_persistent"] == 1.5
    (memory,) = entry["memory"]
    assert memory["staging_peak_over_budget"] == 1.5
    assert memory["writer_rss_growth_over_budget"] == 3.0
