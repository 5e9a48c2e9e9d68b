"""Staging within a memory budget on a real 2-rank gloo job (one launch)."""

import pytest

from tests.functional import scenarios_staging_budget
from tests.functional.harness import assert_scenario_ok, launch_once, selected_scenarios

SCENARIOS = list(scenarios_staging_budget.SCENARIOS)


@pytest.fixture(scope="module")
def launch_results(request, tmp_path_factory):
    return launch_once(
        "tests.functional.scenarios_staging_budget:run_all", 2, tmp_path_factory,
        timeout_s=400.0, only=selected_scenarios(request),
    )


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(launch_results, scenario):
    assert_scenario_ok(launch_results, scenario)
