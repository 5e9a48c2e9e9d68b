"""Smoke test of the scale benchmark (tools/bench/scale.py) at a tiny size."""

import pytest

from tools.bench import scale


@pytest.mark.parametrize("layout", scale.LAYOUTS)
def test_synthesized_plans_are_a_valid_global_plan_for_every_method(layout, tmp_path):
    plans, results = scale.synthesize(layout, 16, 3)
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


def test_one_measurement_in_a_child_process_and_the_report(tmp_path):
    result = scale.measure("ours", "tp8", 16, 3, timeout_s=120)
    assert (result.ranks, result.items_per_rank, result.items) == (16, 3, 48)
    assert result.plan_s > 0 and result.commit_s > 0 and result.metadata_bytes > 0
    table = scale.render([result, scale.measure("dcp", "tp8", 16, 3, timeout_s=120)])
    assert "| tp8 | 16 x 3 |" in table and "ours / DCP" in table


def test_the_warm_row_runs_the_real_finalization_and_gathers_nothing(tmp_path):
    from tools.bench.gather_model import measure_gathers
    from tools.bench.scale_warm import measure_warm_finalize

    plans, results = scale.synthesize("tp8", 16, 3)
    warm = measure_warm_finalize(scale._plan("ours", plans), results, str(tmp_path))
    assert warm["warm_s"] > 0 and 0 < warm["cpu_s"] <= warm["warm_s"] + warm["write_s"]
    assert warm["metadata_bytes"] == (tmp_path / "iter_1" / ".metadata").stat().st_size
    assert measure_gathers("ours", plans, results)["result_gather"]["num_bytes"] > 0
    result = scale.measure("ours_warm", "tp8", 16, 3, timeout_s=120)
    assert result.gathered_bytes == 0 and result.warm_cpu_s >= 0
    assert "ours_warm" in scale.render([result]) and "checks + splice" in scale.render([result])
