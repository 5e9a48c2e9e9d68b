"""Smoke test of the gather calibration (tools/bench/gather_calibration.py) at 2 ranks, tiny K.

Only the shape of the output is checked: timings belong in the benchmark, never in tests.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import scale
from tools.bench.gather_model import OPS, render_scale_estimates

REPO_ROOT = Path(__file__).resolve().parents[3]
_ITEMS = (5, 40)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_calibration_times_every_collective_and_folds_into_the_scale_report(tmp_path):
    out = tmp_path / "bench"
    command = [
        sys.executable, str(REPO_ROOT / "tools" / "benchmark.py"), "--scale", "--calibrate",
        "--ranks", "2", "--items-per-rank", ",".join(map(str, _ITEMS)), "--repeats", "2",
        "--launch-timeout-s", "200", "--collective-timeout-s", "60", "--out", str(out),
    ]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=260)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calibration = json.loads((out / "gather_calibration.json").read_text())

    rows = {(r["op"], r["items_per_rank"]): r for r in calibration["rows"]}
    assert set(rows) == {(op, items) for op in OPS for items in _ITEMS}
    for row in rows.values():
        assert row["ranks"] == 2 and len(row["times_s"]) == 2
        assert row["median_s"] > 0 and row["per_item_us"] > 0
        assert (row["decode_s"] > 0) == (row["op"] != "warm_allreduces")
    for op in OPS:
        small, large = rows[op, _ITEMS[0]]["num_bytes"], rows[op, _ITEMS[1]]["num_bytes"]
        if op == "warm_allreduces":
            assert small == large == 0
        else:
            assert 0 < small < large
    assert set(calibration["fits"]) == set(OPS)
    assert {(e["op"], e["ranks"], e["items_per_rank"]) for e in calibration["extrapolated"]} == {
        (op, n, items) for op in OPS for n, items in ((1024, 300), (4096, 250))
    }
    assert all(e["estimate_s"] >= 0 and e["num_bytes"] >= 0 for e in calibration["extrapolated"])
    assert "Extrapolated" in (out / "gather_calibration.md").read_text()

    methods = ("ours", "dcp", "ours_warm")
    results = [scale.measure(method, "tp8", 16, 3, timeout_s=120) for method in methods]
    for r in results[:2]:  # ours and DCP: both gathers at full size, bytes and unpickling
        assert r.plan_gathered_bytes == r.gathers["plan_gather"]["num_bytes"] > 0
        assert r.gathered_bytes == r.gathers["result_gather"]["num_bytes"] > 0
        assert all(g["unpickle_s"] > 0 for g in r.gathers.values())
    table = render_scale_estimates(results, calibration)
    for method in methods:
        assert f"| tp8 | 16 x 3 | {method} |" in table
