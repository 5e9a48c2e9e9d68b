"""The object-store benchmark row runs end to end at minimal sizes on the loopback server.

Only the shape of the output is checked: timings belong in the benchmark, never in tests.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.object_store import object_store_skip_reason

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(240)
@pytest.mark.skipif(object_store_skip_reason() is not None, reason=str(object_store_skip_reason()))
def test_object_store_row_writes_both_sides(tmp_path):
    out = tmp_path / "bench"
    command = [
        sys.executable, str(REPO_ROOT / "tools" / "benchmark.py"), "--object-store",
        "--ranks", "2", "--bytes-per-rank", "6MiB", "--part-bytes", "5MiB",
        "--tensor-count", "2", "--repeats", "1", "--caller", "temporal", "--out", str(out),
    ]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "object_store.json").read_text())
    assert result["endpoint"] == "moto on 127.0.0.1"
    assert result["ranks"] == 2 and result["bytes_per_rank"] == 6 << 20
    assert len(result["repeats"]) == 1
    assert {"ours_total_s", "ours_stall_s", "boto3_total_s"} == set(result["repeats"][0])
    assert result["ours_bytes_per_s"] > 0 and result["boto3_bytes_per_s"] > 0
    assert "ours / boto3" in proc.stdout
