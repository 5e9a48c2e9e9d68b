"""Checkpoint coordination while megatron-core re-creates its groups (4 gloo ranks, one launch).

Regression test for saves that hung in a long-lived process whose ranks created the
coordination group at different points of their sequence of group creations.
"""

import pytest

from tests.functional import scenarios_group_lifecycle
from tests.functional.harness import assert_scenario_ok, launch_once, selected_scenarios

SCENARIOS = list(scenarios_group_lifecycle.SCENARIOS)


@pytest.fixture(scope="module")
def launch_results(request, tmp_path_factory):
    return launch_once(
        "tests.functional.scenarios_group_lifecycle:run_all",
        4,
        tmp_path_factory,
        timeout_s=400,
        only=selected_scenarios(request),
    )


@pytest.mark.slow
@pytest.mark.timeout(450)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(launch_results, scenario):
    assert_scenario_ok(launch_results, scenario)
