"""Async core semantics on real gloo jobs: every scenario on 2 ranks, and those where one
rank differs from several others on 4 ranks (one launch per world size)."""

import pytest

from tests.functional import scenarios_core
from tests.functional.harness import assert_scenario_ok, launch_once, selected_scenarios

SCENARIOS = list(scenarios_core.SCENARIOS)
FOUR_RANK_SCENARIOS = scenarios_core.FOUR_RANK_SCENARIOS


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    return launch_once(
        "tests.functional.scenarios_core:run_all", 2, tmp_path_factory,
        only=selected_scenarios(request, "test_scenario", SCENARIOS),
    )


@pytest.fixture(scope="module")
def four_ranks(request, tmp_path_factory):
    only = selected_scenarios(request, "test_scenario_4ranks", FOUR_RANK_SCENARIOS)
    return launch_once(
        "tests.functional.scenarios_core:run_all", 4, tmp_path_factory,
        only=list(FOUR_RANK_SCENARIOS) if only is None else only,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(two_ranks, scenario):
    assert_scenario_ok(two_ranks, scenario)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", FOUR_RANK_SCENARIOS)
def test_scenario_4ranks(four_ranks, scenario):
    assert_scenario_ok(four_ranks, scenario)
