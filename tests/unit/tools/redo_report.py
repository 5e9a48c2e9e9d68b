"""Shared check of the benchmark smoke tests: report.md can be redone from results.json."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def assert_report_redone(out: Path, tmp_path: Path) -> None:
    """``--from-results`` measures nothing and writes the same report.md again."""
    again = tmp_path / "again"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "benchmark.py"),
         "--from-results", str(out / "results.json"), "--out", str(again)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (again / "report.md").read_text() == (out / "report.md").read_text()
