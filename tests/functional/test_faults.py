"""Fault-injection suite: every fault raises on every rank and never costs the last good
checkpoint (2 ranks, one launch; see scenarios_faults.py for each fault's set-up)."""

import pytest

from tests.functional import scenarios_faults
from tests.functional.harness import assert_scenario_ok, launch, launch_once, selected_scenarios

SCENARIOS = list(scenarios_faults.SCENARIOS)


@pytest.fixture(scope="module")
def launch_results(request, tmp_path_factory):
    return launch_once(
        "tests.functional.scenarios_faults:run_all",
        2,
        tmp_path_factory,
        timeout_s=400,
        only=selected_scenarios(request),
    )


@pytest.mark.timeout(450)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fault(launch_results, scenario):
    assert_scenario_ok(launch_results, scenario)


@pytest.mark.timeout(200)
def test_rank_stopped_during_finalize(tmp_path):
    """Its own launch: see scenarios_faults.rank_stopped_during_finalize."""
    survivor, stopped = launch(
        "tests.functional.scenarios_faults:rank_stopped_during_finalize", 2, str(tmp_path), timeout_s=180
    )
    assert survivor["error"] == "CoordinationError" and "all_reduce" in survivor["message"], survivor
    assert stopped["error"] == "CoordinationError", stopped  # its peer left the collective
    for outcome in (survivor, stopped):  # the launch's first scenario
        hung = outcome["hung_commit"]
        assert hung["failures"][0][0] == "finalize", hung
        assert "FileSystemStepTimeoutError" in hung["lines"][0], hung
