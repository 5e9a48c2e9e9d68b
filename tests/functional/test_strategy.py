"""The torch_dist async save strategy on real gloo jobs of 2 and 4 ranks (one launch each)."""

import pytest

from tests.functional.harness import assert_scenario_ok, launch_once

SCENARIOS = (
    ["sync_save_round_trip"]
    + [
        f"{name}[{kind}]"
        for kind in ("temporal", "persistent")
        for name in (
            "async_equals_sync",
            "in_place_updates_after_schedule_are_not_saved",
            "cached_metadata_skips_plan_gathers",
            "cached_data_structure_and_multiproc_io",
            "write_failure_on_one_rank",
            "killed_worker_on_one_rank",
        )
    ]
    + [
        "structure_change_on_one_rank_plans_everywhere",
        "loaded_metadata_skips_the_first_gather",
        "all_replicas_with_central_planning",
        "separation_hint_files",
        "fully_parallel_wrapper",
        "a_rank_with_nothing_to_write",
        "empty_tensors",
        "registered_backend",
        "bad_inputs",
        "second_save_into_a_directory_in_flight",
    ]
)

@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def launch_results(request, tmp_path_factory):
    return launch_once("tests.functional.scenarios_strategy:run_all", request.param, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(launch_results, scenario):
    assert_scenario_ok(launch_results, scenario)
