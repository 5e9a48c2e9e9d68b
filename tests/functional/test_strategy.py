"""The torch_dist async save strategy on real gloo jobs: every scenario on 2 ranks, and the
scenarios whose rank count is what is tested on 4 ranks (one launch per world size)."""

import pytest

from tests.functional import scenarios_strategy
from tests.functional.harness import assert_scenario_ok, launch_once, selected_scenarios

SCENARIOS = list(scenarios_strategy.SCENARIOS)
FOUR_RANK_SCENARIOS = scenarios_strategy.FOUR_RANK_SCENARIOS


def _launch(request, tmp_path_factory, world_size, test, registry):
    only = selected_scenarios(request, test, registry)
    if only is None and registry != SCENARIOS:
        only = list(registry)
    return launch_once(
        "tests.functional.scenarios_strategy:run_all",
        world_size,
        tmp_path_factory,
        only=only,
        # One launch runs its scenarios (about a minute at 2 ranks on a busy 2-core
        # machine); the bound catches a hang, with room for a loaded machine.
        timeout_s=360.0,
    )


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    return _launch(request, tmp_path_factory, 2, "test_scenario", SCENARIOS)


@pytest.fixture(scope="module")
def four_ranks(request, tmp_path_factory):
    return _launch(request, tmp_path_factory, 4, "test_scenario_4ranks", FOUR_RANK_SCENARIOS)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(two_ranks, scenario):
    assert_scenario_ok(two_ranks, scenario)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("scenario", FOUR_RANK_SCENARIOS)
def test_scenario_4ranks(four_ranks, scenario):
    assert_scenario_ok(four_ranks, scenario)
