"""Smoke tests of the scale benchmark (tools/bench/scale.py, with its synthesized plans in
scale_plans.py and its report in scale_report.py) and its gather calibration
(tools/bench/gather_calibration.py) at tiny sizes.

Each method is measured once, in a child process, for the whole module. Only the shape of
the output is checked: timings belong in the benchmark, never in tests.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import scale, scale_plans, scale_report
from tools.bench.gather_model import OPS, render_scale_estimates

REPO_ROOT = Path(__file__).resolve().parents[3]
_ITEMS = (5, 40)
_METHODS = ("ours", "dcp", "ours_warm")


@pytest.fixture(scope="module")
def measured():
    """``{method: scale.measure(method, "tp8", 16, 3)}``, one child process per method."""
    return {method: scale.measure(method, "tp8", 16, 3, timeout_s=120) for method in _METHODS}


@pytest.mark.parametrize("layout", scale_plans.LAYOUTS)
def test_synthesized_plans_are_a_valid_global_plan_for_every_method(layout, tmp_path):
    plans, results = scale_plans.synthesize(layout, 16, 3)
    assert len(plans) == len(results) == 16 and all(len(p.items) == 3 for p in plans)
    sizes, built = {}, {}
    for method in ("ours", "dcp"):
        metadata = built[method] = scale._plan(method, plans)
        directory = tmp_path / method
        directory.mkdir()
        sizes[method] = scale._commit(method, metadata, results, str(directory))
        chunks = sum(len(md.chunks) for md in metadata.state_dict_metadata.values())
        assert chunks == 16 * 3
    assert sizes["ours"] > 0 and sizes["dcp"] > 0
    assert built["ours"].state_dict_metadata == built["dcp"].state_dict_metadata
    # A 16-byte digest per rank more than DCP's, less what equal chunk sizes shared save.
    assert sizes["ours"] - sizes["dcp"] <= 16 * 24


def test_given_sizes_replace_the_grid():
    assert scale._sizes("1024x300,4096x250") == [(1024, 300), (4096, 250)]


@pytest.mark.timeout(400)
def test_one_measurement_in_a_child_process_and_the_report(measured):
    result = measured["ours"]
    assert (result.ranks, result.items_per_rank, result.items) == (16, 3, 48)
    assert result.plan_s > 0 and result.commit_s > 0 and result.metadata_bytes > 0
    table = scale_report.render([result, measured["dcp"]])
    assert "| tp8 | 16 x 3 |" in table and "ours / DCP" in table


@pytest.mark.timeout(400)
def test_the_warm_row_runs_the_real_finalization_and_gathers_nothing(tmp_path, measured):
    from tools.bench.gather_model import measure_gathers
    from tools.bench.scale_warm import measure_warm_finalize

    plans, results = scale_plans.synthesize("tp8", 16, 3)
    warm = measure_warm_finalize(scale._plan("ours", plans), results, str(tmp_path))
    assert warm["warm_s"] > 0 and 0 < warm["cpu_s"] <= warm["warm_s"] + warm["write_s"]
    assert warm["metadata_bytes"] == (tmp_path / "iter_1" / ".metadata").stat().st_size
    assert measure_gathers("ours", plans, results)["result_gather"]["num_bytes"] > 0
    result = measured["ours_warm"]
    assert result.gathered_bytes == 0 and result.warm_cpu_s >= 0
    table = scale_report.render([result])
    assert "ours_warm" in table and "checks + splice" in table


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_calibration_times_every_collective_and_folds_into_the_scale_report(tmp_path, measured):
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

    results = [measured[method] for method in _METHODS]
    for r in results[:2]:  # ours and DCP: both gathers at full size, bytes and unpickling
        assert r.plan_gathered_bytes == r.gathers["plan_gather"]["num_bytes"] > 0
        assert r.gathered_bytes == r.gathers["result_gather"]["num_bytes"] > 0
        assert all(g["unpickle_s"] > 0 for g in r.gathers.values())
    table = render_scale_estimates(results, calibration)
    for method in _METHODS:
        assert f"| tp8 | 16 x 3 | {method} |" in table
