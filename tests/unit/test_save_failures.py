"""The save failure policy: which failures a job absorbs, and when it stops."""

import logging

import pytest

from megatron_async.errors import (
    AsyncSaveFailedError,
    CheckpointValidationError,
    CoordinationError,
    RankFailure,
)
from megatron_async.manager import CheckpointManager, CheckpointManagerConfig
from megatron_async.save_failures import SaveFailurePolicy, SaveFailureTracker, TooManySaveFailuresError


def _write_failure(rank=1, checkpoint="/ckpt/iter_0000004"):
    failure = RankFailure.from_exception(rank, "write", OSError(28, "No space left on device"))
    return AsyncSaveFailedError({rank: failure}, checkpoint)


@pytest.mark.parametrize(
    "options, fragment",
    [({"mode": "ignore"}, "must be one of"), ({"max_consecutive_failures": 0}, ">= 1")],
)
def test_invalid_policies_are_refused(options, fragment):
    with pytest.raises(CheckpointValidationError, match=fragment):
        SaveFailurePolicy(**options)


def test_the_default_policy_raises_the_failure_itself():
    error = _write_failure()
    with pytest.raises(AsyncSaveFailedError) as raised:
        SaveFailureTracker().failed(error, "iteration 4")
    assert raised.value is error


def test_continue_logs_every_rank_cause_and_stops_at_the_limit(caplog):
    tracker = SaveFailureTracker(SaveFailurePolicy(mode="continue", max_consecutive_failures=3))
    with caplog.at_level(logging.ERROR, logger="megatron_async.save_failures"):
        tracker.failed(_write_failure(), "iteration 4")
        tracker.failed(CheckpointValidationError("target is not writable"), "iteration 6")
    assert "iteration 4" in caplog.text and "No space left on device" in caplog.text
    assert "rank 1" in caplog.text and "(1 in a row, 3 allowed)" in caplog.text
    assert tracker.consecutive_failures == 2
    with pytest.raises(TooManySaveFailuresError) as raised:
        tracker.failed(_write_failure(checkpoint="/ckpt/iter_0000008"), "iteration 8")
    assert isinstance(raised.value, AsyncSaveFailedError)
    assert set(raised.value.rank_failures) == {1}
    assert "3 checkpoint saves failed in a row" in str(raised.value)
    assert raised.value.checkpoint == "/ckpt/iter_0000008"


def test_a_success_resets_the_count():
    tracker = SaveFailureTracker(SaveFailurePolicy(mode="continue", max_consecutive_failures=2))
    tracker.failed(_write_failure(), "iteration 4")
    tracker.succeeded()
    tracker.failed(_write_failure(), "iteration 8")
    assert tracker.consecutive_failures == 1


@pytest.mark.parametrize("error", [CoordinationError("peer lost"), RuntimeError("a bug")])
def test_a_lost_peer_or_a_bug_is_never_absorbed(error):
    tracker = SaveFailureTracker(SaveFailurePolicy(mode="continue", max_consecutive_failures=5))
    with pytest.raises(type(error)):
        tracker.failed(error, "iteration 4")
    assert tracker.consecutive_failures == 0


def test_the_manager_forgets_the_failed_save_and_goes_on(tmp_path):
    manager = CheckpointManager(CheckpointManagerConfig(
        save_dir=str(tmp_path), save_failure=SaveFailurePolicy(mode="continue"),
    ))
    manager.prepare_save(4)
    assert manager.in_flight == {4}
    manager.save_failed(4, _write_failure())
    assert manager.in_flight == set()
    manager.prepare_save(4)  # the same iteration may be saved again
    assert manager.save_failures.consecutive_failures == 1
