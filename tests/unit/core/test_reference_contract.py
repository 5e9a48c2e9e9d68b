"""The queue and callers as code written against the reference API uses them.

DCP-style failure handlers, requests built by other libraries, the reference's
constructor switches, the one INFO line per finalized save, and the background writer's
lower CPU priority (single process, both callers).
"""

import logging
import os
import pickle
import traceback

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from megatron_async.core import (
    AsyncCallerConfig,
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
)
from megatron_async.core.request import SaveDetails
from megatron_async.errors import AsyncSaveFailedError, RemoteFailureError, ReplacedReferenceAPIError
from tests import background_fns as fns

pytestmark = pytest.mark.timeout(120)

CALLER_KINDS = [pytest.param(False, id="temporal"), pytest.param(True, id="persistent")]


@pytest.fixture
def make_queue():
    queues = []

    def factory(persistent, **kwargs):
        queue = AsyncCallsQueue(persistent=persistent, **kwargs)
        queues.append(queue)
        return queue

    yield factory
    for queue in queues:
        queue.close(abort=True)


def _dcp_style_report(exc: CheckpointException) -> dict:
    """What a handler written for PyTorch DCP does with ``failures``."""
    report = {}
    for rank, (error, trace) in exc.failures.items():
        text = "".join(traceback.format_list(trace))
        text += "".join(traceback.format_exception_only(type(error), error))
        report[rank] = (error, text)
    return report


def _failed_save(queue, fn, path, arg) -> AsyncSaveFailedError:
    """Run one request whose background part raises; return what the queue raised."""
    queue.schedule_async_request(AsyncRequest(fn, (str(path), None, arg), []))
    with pytest.raises(CheckpointException) as info:  # what DCP-style code catches
        queue.maybe_finalize_async_calls(blocking=True)
    assert isinstance(info.value, AsyncSaveFailedError)
    return info.value


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_a_dcp_style_handler_unpacks_failures(make_queue, tmp_path, persistent):
    failed = _failed_save(make_queue(persistent), fns.raise_error, tmp_path, "disk on fire")
    ((rank, (error, text)),) = _dcp_style_report(failed).items()
    # The background exception arrives as an object of its own type.
    assert rank == 0 and type(error) is OSError and str(error) == "disk on fire"
    assert "raise_error" in text and "OSError: disk on fire" in text
    assert failed.rank_failures[0].phase == "write"  # the full record stays available
    # The error pickles (it crosses ranks) and keeps both views.
    copy = pickle.loads(pickle.dumps(failed))
    assert type(copy.failures[0][0]) is OSError and copy.rank_failures[0].phase == "write"


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_an_exception_that_cannot_be_unpickled_is_named(make_queue, tmp_path, persistent):
    failed = _failed_save(make_queue(persistent), fns.raise_unpicklable, tmp_path, "odd")
    error, _ = failed.failures[0]
    assert isinstance(error, RemoteFailureError)
    assert "UnpicklableError" in str(error) and "odd" in str(error)


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_a_foreign_request_with_nothing_to_write_runs(make_queue, persistent):
    """megatron-core's ``AsyncRequest(save_fn, save_args, ...)`` from ``(None, None, None)``."""
    queue = make_queue(persistent, is_daemon=True)  # the reference's switch is accepted
    finalized = []
    queue.schedule_async_request(AsyncRequest(None, None, [lambda: finalized.append(1)], preload_fn=None))
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert finalized == [1]
    AsyncRequest(None, None, [lambda: finalized.append(2)]).execute_sync()
    assert finalized == [1, 2]


class _DescribedFinalize:
    """A finalize function that knows its save, like our strategy's commit step."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def __call__(self):
        pass

    def save_details(self):
        return SaveDetails(self.checkpoint, 2_000_000_000, 1024, 1, plan_s=0.01, write_s=0.5)


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_one_info_line_per_finalized_save(make_queue, tmp_path, persistent, caplog):
    queue = make_queue(persistent)
    caplog.set_level(logging.INFO, logger="megatron_async")
    for step in range(2):
        finalize = _DescribedFinalize(f"ckpt-{step}")
        queue.schedule_async_request(AsyncRequest(fns.write_text, (str(tmp_path / f"f{step}"), None, "x"), [finalize]))
        queue.maybe_finalize_async_calls(blocking=True)
    queue.schedule_async_request(AsyncRequest(fns.write_text, (str(tmp_path / "plain"), None, "x"), []))
    queue.maybe_finalize_async_calls(blocking=True)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 2, lines  # a request that cannot name its save logs none
    for step in range(2):
        (line,) = [text for text in lines if f"ckpt-{step}" in text]
        assert "stall" in line and "background write 0.500s" in line
        assert "2000000000 bytes" in line and "4.00 GB/s" in line
    assert not [r for r in caplog.records if r.levelno > logging.INFO]


def _recorded_nice(queue, path):
    queue.schedule_async_request(AsyncRequest(fns.record_nice, (str(path), None), []))
    queue.maybe_finalize_async_calls(blocking=True)
    return int(path.read_text())


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_the_writer_runs_at_a_lower_priority_than_the_trainer(make_queue, tmp_path, persistent):
    trainer_nice = os.nice(0)
    assert _recorded_nice(make_queue(persistent), tmp_path / "default") == min(19, trainer_nice + 10)
    assert os.nice(0) == trainer_nice
    unchanged = AsyncCallerConfig(writer_nice_increment=0)
    assert _recorded_nice(make_queue(persistent, config=unchanged), tmp_path / "inherit") == trainer_nice


def test_priority_options_are_checked():
    for wrong in (-5, 20, 1.5, True):
        with pytest.raises(ValueError, match="writer_nice_increment"):
            AsyncCallerConfig(writer_nice_increment=wrong)


def test_the_reference_worker_loop_says_what_to_use_instead():
    with pytest.raises(ReplacedReferenceAPIError, match=r"AsyncCallsQueue\(persistent=True\)"):
        PersistentAsyncCaller.async_loop(0, None, None, None)


def test_a_caller_used_directly_reports_its_call_and_raises_its_failure(tmp_path):
    """``is_current_async_call_done`` of a caller without the queue, as the reference's
    loop calls it: done once the call finished, the failure raised as on the queue."""
    from megatron_async.core import TemporalAsyncCaller

    done = TemporalAsyncCaller()
    assert done.is_current_async_call_done()  # nothing scheduled
    done.schedule_async_call(AsyncRequest(fns.write_text, (str(tmp_path / "ok"), None, "ok"), []))
    assert done.is_current_async_call_done(blocking=True)
    assert (tmp_path / "ok").read_text() == "ok"
    done.close()
    failed = TemporalAsyncCaller()
    failed.schedule_async_call(AsyncRequest(fns.raise_error, (str(tmp_path / "x"), None, "disk full"), []))
    with pytest.raises(AsyncSaveFailedError, match="disk full"):
        failed.is_current_async_call_done(blocking=True, no_dist=True)
    failed.close()
