"""Async core semantics on real gloo jobs of 2 and 4 ranks (one launch per world size)."""

import pytest

from tests.functional.harness import assert_scenario_ok, launch_once

SCENARIOS = [
    f"{name}[{kind}]"
    for kind in ("temporal", "persistent")
    for name in (
        "finalize_waits_for_every_rank",
        "write_error_on_one_rank",
        "staging_error_on_one_rank",
        "worker_killed_on_one_rank",
        "hung_writer_on_one_rank",
        "calls_in_flight_finalize_in_order",
        "torch_async_checkpoint_snapshot",
    )
] + [
    "our_request_runs_through_megatron_execute_sync",
    "megatron_queue_fails_on_cpu_only_torch",
    "our_request_on_megatron_queue",
]

@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def launch_results(request, tmp_path_factory):
    return launch_once("tests.functional.scenarios_core:run_all", request.param, tmp_path_factory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(launch_results, scenario):
    assert_scenario_ok(launch_results, scenario)
