"""Fault-injection suite: every fault raises on every rank and never costs the last good
checkpoint (2 ranks, one launch; see scenarios_faults.py for each fault's set-up)."""

import pytest

from tests.functional.harness import assert_scenario_ok, launch_once

SCENARIOS = [
    "exception_while_planning",
    "exception_while_finalizing",
    "metadata_json_cannot_be_written",
    "damaged_files_are_detected",
    "second_save_into_a_directory_being_written",
] + [
    f"{name}[{kind}]"
    for kind in ("temporal", "persistent")
    for name in (
        "disk_full",
        "exception_while_staging",
        "exception_while_writing",
        "target_directory_removed_during_write",
        "worker_killed_mid_write",
        "worker_hangs",
        "two_saves_in_flight_to_different_directories",
        "permission_denied",
    )
]


@pytest.fixture(scope="module")
def launch_results(tmp_path_factory):
    return launch_once("tests.functional.scenarios_faults:run_all", 2, tmp_path_factory, timeout_s=400)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fault(launch_results, scenario):
    assert_scenario_ok(launch_results, scenario)
