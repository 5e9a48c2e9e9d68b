"""Local checkpoints replicated to peers on one 4-rank gloo launch (two "nodes" of 2 ranks,
replication jump 2, factor 2): async saves, recovery after a lost node and past damaged
copies, and megatron-core's MCoreTensorAwareStateDict the way Megatron-LM uses it."""

import pytest

from tests.functional import scenarios_local
from tests.functional.harness import assert_scenario_ok, launch_once, selected_scenarios


@pytest.fixture(scope="module")
def four_ranks(request, tmp_path_factory):
    return launch_once(
        "tests.functional.scenarios_local:run_all",
        4,
        tmp_path_factory,
        only=selected_scenarios(request),
        # Four ranks on a busy 2-core machine: the bound catches a hang.
        timeout_s=420.0,
    )


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("scenario", list(scenarios_local.SCENARIOS))
def test_scenario(four_ranks, scenario):
    assert_scenario_ok(four_ranks, scenario)
