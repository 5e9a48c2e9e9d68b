"""Async core semantics on real gloo jobs of 2 and 4 ranks (one launch per world size)."""

import pytest

from tests.functional import scenarios_core
from tests.functional.harness import assert_scenario_ok, launch_once, selected_scenarios

SCENARIOS = list(scenarios_core.SCENARIOS)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def launch_results(request, tmp_path_factory):
    return launch_once(
        "tests.functional.scenarios_core:run_all",
        request.param,
        tmp_path_factory,
        only=selected_scenarios(request),
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(launch_results, scenario):
    assert_scenario_ok(launch_results, scenario)
