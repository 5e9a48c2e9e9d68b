"""The save failure policy: which failures a job absorbs, and when it stops."""

import logging
import os

import pytest

from megatron_async.errors import (
    AsyncSaveFailedError,
    CheckpointValidationError,
    CoordinationError,
    RankFailure,
)
from megatron_async.format import COMPLETION_MARKERS
from megatron_async.manager import (
    CheckpointManager,
    CheckpointManagerConfig,
    SaveFailurePolicy,
    TooManySaveFailuresError,
)


def _manager(tmp_path, **policy) -> CheckpointManager:
    return CheckpointManager(CheckpointManagerConfig(
        save_dir=str(tmp_path), save_failure=SaveFailurePolicy(**policy),
    ))


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


def test_the_default_policy_raises_the_failure_itself(tmp_path):
    error = _write_failure()
    with pytest.raises(AsyncSaveFailedError) as raised:
        _manager(tmp_path).save_failed(4, error)
    assert raised.value is error


def test_continue_logs_every_rank_cause_and_stops_at_the_limit(tmp_path, caplog):
    manager = _manager(tmp_path, mode="continue", max_consecutive_failures=3)
    with caplog.at_level(logging.ERROR, logger="megatron_async.manager"):
        manager.save_failed(4, _write_failure())
        manager.save_failed(6, CheckpointValidationError("target is not writable"))
    assert "iteration 4" in caplog.text and "No space left on device" in caplog.text
    assert "rank 1" in caplog.text and "(1 in a row, 3 allowed)" in caplog.text
    assert manager.consecutive_save_failures == 2
    with pytest.raises(TooManySaveFailuresError) as raised:
        manager.save_failed(8, _write_failure(checkpoint="/ckpt/iter_0000008"))
    assert isinstance(raised.value, AsyncSaveFailedError)
    assert set(raised.value.rank_failures) == {1}
    assert "3 checkpoint saves failed in a row" in str(raised.value)
    assert raised.value.checkpoint == "/ckpt/iter_0000008"


def test_a_success_resets_the_count(tmp_path):
    manager = _manager(tmp_path, mode="continue", max_consecutive_failures=2)
    manager.save_failed(4, _write_failure())
    path = manager.prepare_save(8)
    for marker in COMPLETION_MARKERS:
        open(os.path.join(path, marker), "w").close()
    manager.commit(8)
    manager.save_failed(12, _write_failure())
    assert manager.consecutive_save_failures == 1


@pytest.mark.parametrize("error", [CoordinationError("peer lost"), RuntimeError("a bug")])
def test_a_lost_peer_or_a_bug_is_never_absorbed(tmp_path, error):
    manager = _manager(tmp_path, mode="continue", max_consecutive_failures=5)
    with pytest.raises(type(error)):
        manager.save_failed(4, error)
    assert manager.consecutive_save_failures == 0


def test_the_manager_forgets_the_failed_save_and_goes_on(tmp_path):
    manager = _manager(tmp_path, mode="continue")
    manager.prepare_save(4)
    assert manager.in_flight == {4}
    manager.save_failed(4, _write_failure())
    assert manager.in_flight == set()
    manager.prepare_save(4)  # the same iteration may be saved again
    assert manager.consecutive_save_failures == 1
