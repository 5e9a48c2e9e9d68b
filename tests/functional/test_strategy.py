"""The torch_dist async save strategy on real gloo jobs of 2 and 4 ranks (one launch each)."""

import pytest

from tests.functional import scenarios_strategy
from tests.functional.harness import assert_scenario_ok, launch_once, selected_scenarios

SCENARIOS = list(scenarios_strategy.SCENARIOS)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def launch_results(request, tmp_path_factory):
    return launch_once(
        "tests.functional.scenarios_strategy:run_all",
        request.param,
        tmp_path_factory,
        only=selected_scenarios(request),
        # One launch runs every scenario (about 2 min at 4 ranks on a quiet 2-core
        # machine); the bound catches a hang, with room for a loaded machine.
        timeout_s=360.0,
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(launch_results, scenario):
    assert_scenario_ok(launch_results, scenario)
