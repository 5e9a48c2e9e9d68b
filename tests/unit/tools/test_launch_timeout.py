"""A benchmark launch that hangs says where: the scenario of megatron-core's persistent caller
that never finished on the H200, with nothing in its log to tell why."""

import time

import pytest

from tools.bench.launch import LaunchError, launch


def hang_in_a_named_function(ctx):
    """A job that never returns (module level: it is pickled into spawned ranks)."""
    del ctx
    while True:
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_launch_past_its_timeout_leaves_each_ranks_stacks_in_the_log(tmp_path):
    log = tmp_path / "ranks.log"
    with pytest.raises(LaunchError, match="ran past") as raised:
        launch(2, hang_in_a_named_function, {}, timeout_s=12, log_path=str(log))
    assert str(log) in str(raised.value)
    text = log.read_text()
    assert text.count("hang_in_a_named_function") >= 2, text[-2000:]
