"""nvidia-resiliency-ext's async checkpointing module surface on a real 2-rank gloo job."""

import pytest

from tests.functional import scenarios_nvrx
from tests.functional.harness import assert_scenario_ok, launch_once, selected_scenarios


@pytest.fixture(scope="module")
def launch_results(request, tmp_path_factory):
    return launch_once(
        "tests.functional.scenarios_nvrx:run_all", 2, tmp_path_factory, only=selected_scenarios(request)
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", list(scenarios_nvrx.SCENARIOS))
def test_scenario(launch_results, scenario):
    assert_scenario_ok(launch_results, scenario)
