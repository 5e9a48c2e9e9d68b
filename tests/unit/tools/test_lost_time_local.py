"""The lost-time benchmark's local-tier rows (``ours_local_f1``, ``ours_local_f2``): their
targets against ``ours_persistent``, and the replicated launch skipped where F = 2 cannot
replicate."""

from tools.bench.lost_time_report import evaluate_lost_time_targets
from tools.bench.lost_time_run import LostTimeOptions, measure_lost_time


def _entry(method, lost, stall):
    return {"method": method, "ranks": 2, "hidden_size": 64, "status": "ok",
            "lost_warm_s": lost, "stall_warm_s": stall, "first_and_setup_s": 1.0,
            "memcpy_s": 0.01}


def test_local_targets_are_ratios_to_the_persistent_save():
    rows = evaluate_lost_time_targets([_entry("ours_persistent", 0.2, 0.1),
                                       _entry("ours_local_f1", 0.3, 0.1),
                                       _entry("ours_local_f2", 0.1, 0.12)])
    unreplicated = {r["target"]: r["verdict"] for r in rows if r["method"] == "ours_local_f1"}
    assert unreplicated == {"local_lost_vs_persistent": "MISS", "local_stall_vs_persistent": "PASS"}
    local = {r["target"]: r for r in rows if r["method"] == "ours_local_f2"}
    assert set(local) == {"local_lost_vs_persistent", "local_stall_vs_persistent"}
    assert local["local_lost_vs_persistent"]["ratio"] == 0.5
    assert local["local_lost_vs_persistent"]["verdict"] == "PASS"
    assert abs(local["local_stall_vs_persistent"]["ratio"] - 1.2) < 1e-9
    assert local["local_stall_vs_persistent"]["verdict"] == "MISS"
    alone = evaluate_lost_time_targets([_entry("ours_local_f2", 0.1, 0.1)])
    assert {r["verdict"] for r in alone} == {"N/A"}


def test_local_method_is_skipped_on_an_odd_rank_count(tmp_path):
    options = LostTimeOptions(mode="only", ranks=(1,), hidden_sizes=(64,),
                              methods=("ours_local_f2",))
    lost = measure_lost_time(options, str(tmp_path), 60, 1, lambda tag: str(tmp_path / tag))
    (entry,) = lost["runs"]
    assert entry["status"] == "skipped" and "even number of ranks" in entry["reason"]
