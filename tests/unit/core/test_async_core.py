"""Single-process behaviour of the async core: requests, both callers, the queue."""

import functools
import logging
import os
import re
import signal
import threading
import time

import pytest
import torch

from megatron_async.core import AsyncCallerConfig, AsyncCallsQueue, AsyncRequest
from megatron_async.core.request import SaveDetails, require_hand_over, run_preload
from megatron_async.errors import (
    AsyncSaveFailedError,
    FrozenRequestError,
    QueueClosedError,
    StagingHandOverError,
)
from tests import background_fns as fns
from tests.persistent_worker import wait_until_worker_ready

pytestmark = pytest.mark.timeout(120)

CALLER_KINDS = [pytest.param(False, id="temporal"), pytest.param(True, id="persistent")]


def _request(fn, path, arg, finalize_fns=None, preload_fn=None):
    return AsyncRequest(fn, (str(path), None, arg), list(finalize_fns or []), preload_fn=preload_fn)


class _Commit:
    """A finalize step that knows its checkpoint, as our strategy's commit step does."""

    def __init__(self, checkpoint, finalized):
        self.checkpoint, self.finalized = str(checkpoint), finalized

    def __call__(self):
        self.finalized.append(self.checkpoint)

    def save_details(self):
        return SaveDetails(self.checkpoint, 0, 0, 0)


@pytest.fixture
def make_queue():
    queues = []

    def factory(persistent, **config):
        queue = AsyncCallsQueue(persistent=persistent, config=AsyncCallerConfig(**config))
        queues.append(queue)
        return wait_until_worker_ready(queue)  # so that persistent saves reach the worker

    yield factory
    for queue in queues:
        queue.close(abort=True)


# -- AsyncRequest ----------------------------------------------------------------------


def test_frozen_request_refuses_finalize_fns():
    request = AsyncRequest(None, (), [])
    request.add_finalize_fn(lambda: None)
    frozen = request.freeze()
    with pytest.raises(FrozenRequestError, match="schedule_async_request"):
        frozen.add_finalize_fn(lambda: None)
    assert len(frozen.finalize_fns) == 1


def test_the_finalize_step_adapter_swaps_steps_when_scheduled_or_run(tmp_path, monkeypatch):
    from megatron_async.core import request as request_module

    calls = []

    def theirs():
        calls.append("theirs")

    def ours():
        calls.append("ours")

    def other():
        calls.append("other")

    monkeypatch.setattr(request_module, "finalize_step_adapter", lambda fn: ours if fn is theirs else None)
    request = AsyncRequest(None, (), [theirs, other])
    assert request.freeze().finalize_fns == [ours, other]
    assert request.finalize_fns == [theirs, other]  # the caller's request is left alone
    request.execute_sync()
    assert calls == ["ours", "other"]


def test_a_config_that_is_no_async_caller_config_is_a_validation_error():
    from megatron_async.errors import CheckpointValidationError

    with pytest.raises(CheckpointValidationError, match=r"config=AsyncCallerConfig\(timeout_s"):
        AsyncCallsQueue(config={"timeout_s": 5})


def test_execute_sync_stages_into_second_argument_and_finalizes_in_order(tmp_path):
    calls = []
    request = AsyncRequest(
        fns.write_text,
        (str(tmp_path / "out"), "placeholder", "value"),
        [lambda: calls.append("a")],
        preload_fn=lambda: "staged",
    )
    request.add_finalize_fn(lambda: calls.append("b"))
    request.execute_sync()
    assert (tmp_path / "out").read_text() == "value:staged"
    assert calls == ["a", "b"]


def test_execute_sync_failure_raises_and_skips_finalize(tmp_path):
    calls = []
    request = AsyncRequest(fns.raise_error, (str(tmp_path), None, "boom"), [lambda: calls.append(1)])
    with pytest.raises(AsyncSaveFailedError, match="boom"):
        request.execute_sync()
    assert calls == []


def test_config_rejects_non_positive_bounds():
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        AsyncCallerConfig(timeout_s=0)


# -- queue + callers ---------------------------------------------------------------------


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_schedule_and_finalize_runs_finalize_fns_in_order(make_queue, tmp_path, persistent):
    queue = make_queue(persistent)
    order = []
    out = tmp_path / "out"
    idx = queue.schedule_async_request(
        _request(fns.write_text, out, "x", [lambda: order.append(1), lambda: order.append(2)])
    )
    assert idx == 0
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert out.read_text() == "x"
    assert order == [1, 2]
    assert queue.get_num_unfinalized_calls() == 0


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_calls_in_flight_finalize_in_scheduling_order(make_queue, tmp_path, persistent):
    queue = make_queue(persistent)
    finalized = []
    release = tmp_path / "release"
    slow = queue.schedule_async_request(
        _request(fns.write_after_release, tmp_path / "slow", str(release), [lambda: finalized.append("slow")])
    )
    fast = queue.schedule_async_request(
        _request(fns.write_text, tmp_path / "fast", "x", [lambda: finalized.append("fast")])
    )
    if not persistent:
        # Forked processes run side by side: the later call finishes first.
        _wait_for((tmp_path / "fast").exists)
    # The call scheduled first is not done: nothing may finalize yet.
    assert queue.maybe_finalize_async_calls(blocking=False) == []
    assert finalized == []
    release.touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [slow, fast]
    assert finalized == ["slow", "fast"]


@pytest.mark.parametrize("persistent", CALLER_KINDS)
@pytest.mark.parametrize(
    "fn, arg, phase, message",
    [
        pytest.param(fns.raise_error, "disk on fire", "write", "disk on fire", id="exception"),
        pytest.param(fns.kill_self, None, "worker", "killed by signal 9", id="sigkill"),
        pytest.param(fns.segfault, None, "worker", "killed by signal 11", id="segfault"),
        pytest.param(fns.exit_early, 3, "worker", "exited with code 3", id="early-exit"),
    ],
)
def test_background_failure_raises_and_queue_stays_usable(
    make_queue, tmp_path, persistent, fn, arg, phase, message
):
    queue = make_queue(persistent)
    finalized = []
    commit = _Commit(tmp_path / "iter_0000010", finalized)
    queue.schedule_async_request(_request(fn, tmp_path / "bad", arg, [commit]))
    with pytest.raises(AsyncSaveFailedError) as info:
        queue.maybe_finalize_async_calls(blocking=True)
    failure = info.value.rank_failures[0]
    assert failure.phase == phase
    assert message in failure.message
    # The headline names the checkpoint, whatever failed (a dead worker included).
    assert str(info.value).startswith(f"async checkpoint save of {commit.checkpoint} failed on 1 rank(s)")
    assert info.value.checkpoint == commit.checkpoint
    # megatron-core's wording, which log alerts and Megatron-LM's tests search for.
    assert f"rank 0 [{phase}] Worker failure: " in str(info.value), str(info.value)
    assert finalized == [], "a failed save must not be finalized"
    if phase == "write":
        assert "Traceback" in failure.traceback_text and message in failure.traceback_text
    # The queue (and, for the persistent caller, a fresh worker) serves the next save.
    queue.schedule_async_request(_request(fns.write_text, tmp_path / "good", "ok"))
    assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    assert (tmp_path / "good").read_text() == "ok"


def test_a_worker_killed_between_saves_is_told_and_its_replacement_too(make_queue, tmp_path, caplog):
    queue = make_queue(True)
    dead = queue.persistent_caller.process
    os.kill(dead.pid, signal.SIGKILL)  # the OS's OOM killer, say, while the trainer trains
    dead.join(timeout=30)
    with caplog.at_level(logging.WARNING, logger="megatron_async.core.persistent"):
        queue.schedule_async_request(_request(fns.write_text, tmp_path / "next", "ok"))
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(
        f"rank 0: the persistent checkpoint worker (pid {dead.pid}) was killed by signal 9 between saves"
    )
    new_pid = queue.persistent_caller.process.pid
    assert warnings[1] == f"rank 0: started persistent checkpoint worker pid {new_pid} to replace pid {dead.pid}"
    assert (tmp_path / "next").read_text() == "ok"


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_staging_failure_raises_at_finalize(make_queue, tmp_path, persistent):
    queue = make_queue(persistent)
    request = _request(
        fns.write_text, tmp_path / "out", "x", preload_fn=functools.partial(fns.stage_fails, "no host memory")
    )
    queue.schedule_async_request(request)
    with pytest.raises(AsyncSaveFailedError, match="no host memory") as info:
        queue.maybe_finalize_async_calls(blocking=True)
    assert info.value.rank_failures[0].phase == "staging"
    assert "worker failure" not in str(info.value).lower()  # the trainer's side failed
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_hanging_writer_times_out_and_is_killed(capfd, make_queue, tmp_path, persistent):
    queue = make_queue(persistent, timeout_s=2.0)
    pid_file = tmp_path / "pid"
    queue.schedule_async_request(_request(fns.record_pid_and_hang, pid_file, 600.0))
    started = time.monotonic()
    with pytest.raises(AsyncSaveFailedError, match="timeout_s=2") as info:
        queue.maybe_finalize_async_calls(blocking=True)
    assert time.monotonic() - started < 30
    assert info.value.rank_failures[0].phase == "timeout"
    assert "Worker failure: " in str(info.value), str(info.value)
    # Where the writer was: its stacks, written by the writer to the stderr it inherited.
    message = info.value.rank_failures[0].message
    assert "are in rank 0's stderr" in message and "\n" not in message, message
    assert re.search(r'background_fns.py", line \d+ in record_pid_and_hang', capfd.readouterr().err)
    pid = int(pid_file.read_text())
    assert not _pid_alive(pid), "the hanging background process must be killed"


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_an_interrupt_while_scheduling_abandons_the_request_and_stops_its_writer(
        make_queue, tmp_path, monkeypatch, persistent):
    """Ctrl-C while a save is still being staged, after the writer was forked or the request
    sent: the queue abandons the request, so what its steps hold (our commit step's claim on
    the directory) is freed at once, and the writer that could still write it is killed."""
    from megatron_async.core import caller, temporal

    class CommitStep:
        abandoned = 0

        def __call__(self):
            raise AssertionError("never scheduled: never finalized")

        def abandon(self):
            self.abandoned += 1

    writers = []

    def interrupted_while_staging(staged, writer_pid):
        writers.append(writer_pid)
        raise KeyboardInterrupt

    queue = make_queue(persistent)
    monkeypatch.setattr(caller, "hand_over_staged", interrupted_while_staging)
    callers = []  # kept alive, as a traceback being handled keeps them: no kill at collection
    schedule = temporal.TemporalAsyncCaller.schedule_async_call
    monkeypatch.setattr(temporal.TemporalAsyncCaller, "schedule_async_call",
                        lambda self, request: (callers.append(self), schedule(self, request)))
    step = CommitStep()
    with pytest.raises(KeyboardInterrupt):
        queue.schedule_async_request(
            _request(fns.sleep_then_write, tmp_path / "x", 30.0, finalize_fns=[step]))
    assert step.abandoned == 1
    assert queue.get_num_unfinalized_calls() == 0
    assert writers and not _pid_alive(writers[0]), "the writer of an abandoned request must be killed"
    monkeypatch.undo()  # the next save gets a new writer and succeeds
    queue.schedule_async_request(_request(fns.write_text, tmp_path / "after", "ok"))
    queue.maybe_finalize_async_calls(blocking=True)
    assert (tmp_path / "after").read_text() == "ok"


def test_an_interrupt_just_after_the_request_reached_the_worker_kills_the_worker(
        make_queue, tmp_path, monkeypatch):
    """Ctrl-C between the send and the caller's own record of the call: the worker may
    be writing already, so the abandoned request's worker is killed too."""
    from megatron_async.core.worker_process import WorkerProcess

    queue = make_queue(True)
    send = WorkerProcess.send
    workers = []

    def sent_then_interrupted(self, message):
        send(self, message)
        if isinstance(message, tuple) and isinstance(message[0], int):  # a request, not a control message
            workers.append(self.pid)
            raise KeyboardInterrupt

    monkeypatch.setattr(WorkerProcess, "send", sent_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        queue.schedule_async_request(_request(fns.sleep_then_write, tmp_path / "x", 30.0))
    assert queue.get_num_unfinalized_calls() == 0
    assert workers and not _pid_alive(workers[0]), "the worker of an abandoned request must be killed"
    monkeypatch.undo()
    queue.schedule_async_request(_request(fns.write_text, tmp_path / "after", "ok"))
    queue.maybe_finalize_async_calls(blocking=True)
    assert (tmp_path / "after").read_text() == "ok" and not (tmp_path / "x").exists()


class _StagedCounting:
    """Staged data that counts its releases (our StagedData ends its staging-memory loan there)."""

    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_an_interrupt_before_any_writer_took_the_staged_data_frees_it(
        make_queue, tmp_path, monkeypatch, persistent):
    """Ctrl-C while the request is encoded for the worker or before the writer is forked:
    no writer will ever read the staged data, so it is released (a save whose staging
    memory stayed lent would make every later save of the process wait for it, then fail)."""
    from megatron_async.core import temporal
    from megatron_async.core.request_transport import RequestSender

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    queue = make_queue(persistent)
    if persistent:
        monkeypatch.setattr(RequestSender, "encode", interrupted)
    else:
        monkeypatch.setattr(temporal, "_synchronize_cuda_if_used", interrupted)
    staged = _StagedCounting()
    with pytest.raises(KeyboardInterrupt):
        queue.schedule_async_request(
            _request(fns.sleep_then_write, tmp_path / "x", 30.0, preload_fn=lambda: staged))
    assert staged.released >= 1
    assert queue.get_num_unfinalized_calls() == 0
    monkeypatch.undo()  # the next save gets a writer and succeeds
    queue.schedule_async_request(_request(fns.write_text, tmp_path / "after", "ok"))
    queue.maybe_finalize_async_calls(blocking=True)
    assert (tmp_path / "after").read_text() == "ok" and not (tmp_path / "x").exists()


class _StagedRecordingItsWriter:
    """Staged data that records, when released, whether its writer process still runs."""

    def __init__(self, pid_path):
        self.pid_path = pid_path
        self.writer_alive_at_release = []

    def release(self):
        with open(self.pid_path) as f:
            self.writer_alive_at_release.append(_pid_alive(int(f.read())))


def test_an_aborted_temporal_save_releases_its_staged_data_only_after_its_writer_is_gone(
        make_queue, tmp_path):
    """Abort while the forked writer still reads the staged buffers: they are released
    only once the child is reaped (released earlier, the cache would lend them to the next
    save while the old writer still reads them, writing a mix into the checkpoint)."""
    queue = make_queue(False)
    pid_path = tmp_path / "pid"
    staged = _StagedRecordingItsWriter(str(pid_path))
    queue.schedule_async_request(
        _request(fns.record_pid_and_hang, pid_path, 30.0, preload_fn=lambda: staged))
    deadline = time.monotonic() + 60
    while not pid_path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    queue.close(abort=True)
    assert staged.writer_alive_at_release == [False]


def _fork_that_hangs_in_the_child(result_conn, rank, parent_pid, priority, due, fn, args, kwargs,
                                  call_idx):
    """A forked child stuck before our first line (as in CPython gh-112275's deadlock)."""
    (fn_path, _, _) = args
    with open(fn_path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def test_a_forked_writer_that_never_starts_fails_fast_and_is_killed(make_queue, tmp_path,
                                                                     monkeypatch):
    from megatron_async.core import temporal

    monkeypatch.setattr(temporal, "_run_forked_call", _fork_that_hangs_in_the_child)
    queue = make_queue(False, fork_start_timeout_s=1.0)
    pid_file = tmp_path / "pid"
    queue.schedule_async_request(_request(fns.write_text, pid_file, "unused"))
    started = time.monotonic()
    with pytest.raises(AsyncSaveFailedError, match="did not start within fork_start_timeout_s=1s"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert time.monotonic() - started < 30  # not timeout_s (an hour)
    assert not _pid_alive(int(pid_file.read_text())), "the hung child must be killed"
    monkeypatch.undo()  # the next save forks afresh and succeeds
    queue.schedule_async_request(_request(fns.write_text, tmp_path / "after", "ok"))
    queue.maybe_finalize_async_calls(blocking=True)
    assert (tmp_path / "after").read_text() == "ok"


def test_a_forked_writer_that_started_may_run_longer_than_the_start_bound(make_queue, tmp_path):
    queue = make_queue(False, fork_start_timeout_s=0.3)
    queue.schedule_async_request(_request(fns.sleep_then_write, tmp_path / "slow", 1.5))
    queue.maybe_finalize_async_calls(blocking=True)
    assert (tmp_path / "slow").exists()


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_an_exception_while_checking_a_call_fails_it_instead_of_escaping(
    make_queue, tmp_path, persistent, monkeypatch
):
    queue = make_queue(persistent)
    queue.schedule_async_request(_request(fns.write_text, tmp_path / "out", "x"))
    caller = queue.async_calls[0][1]

    def broken_poll(idx):
        raise RuntimeError("a bug while checking the writer")

    monkeypatch.setattr(caller, "poll", broken_poll)
    with pytest.raises(AsyncSaveFailedError, match="a bug while checking the writer") as info:
        queue.maybe_finalize_async_calls(blocking=True)
    assert info.value.rank_failures[0].phase == "finalize"
    monkeypatch.undo()
    queue.schedule_async_request(_request(fns.write_text, tmp_path / "next", "y"))
    assert queue.maybe_finalize_async_calls(blocking=True) == [1]


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_snapshot_is_taken_before_schedule_returns(make_queue, tmp_path, persistent):
    queue = make_queue(persistent)
    tensor = torch.arange(1000, dtype=torch.float32)
    expected = tensor.clone()
    request = AsyncRequest(
        fns.save_staged_tensor,
        (str(tmp_path / "t.pt"), None, None),
        [],
        preload_fn=functools.partial(fns.stage_clone, tensor),
    )
    queue.schedule_async_request(request)
    tensor.mul_(-1).add_(7)  # in place, right after scheduling
    queue.maybe_finalize_async_calls(blocking=True)
    assert torch.equal(torch.load(tmp_path / "t.pt"), expected)


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_staging_that_does_not_copy_still_yields_a_snapshot(make_queue, tmp_path, persistent):
    """megatron-core's preload returns CPU tensors as they are; the write must not see later updates."""
    queue = make_queue(persistent)
    tensor = torch.arange(1000, dtype=torch.float32)
    expected = tensor.clone()
    release = tmp_path / "release"
    request = AsyncRequest(
        fns.save_staged_tensor_after_release,
        (str(tmp_path / "t.pt"), None, str(release)),
        [],
        preload_fn=functools.partial(fns.stage_without_copy, tensor),
    )
    queue.schedule_async_request(request)
    tensor.mul_(-1)  # the trainer's update, before the background write reads the data
    release.touch()
    queue.maybe_finalize_async_calls(blocking=True)
    assert torch.equal(torch.load(tmp_path / "t.pt"), expected)


@pytest.mark.parametrize("persistent", CALLER_KINDS)
def test_close_abort_kills_background_and_closed_queue_refuses(make_queue, tmp_path, persistent):
    queue = make_queue(persistent)
    pid_file = tmp_path / "pid"
    queue.schedule_async_request(_request(fns.record_pid_and_hang, pid_file, 600.0))
    _wait_for(pid_file.exists)
    pid = int(pid_file.read_text())
    queue.close(abort=True)
    _wait_for(lambda: not _pid_alive(pid))
    with pytest.raises(QueueClosedError, match="create a new AsyncCallsQueue"):
        queue.schedule_async_request(_request(fns.write_text, tmp_path / "x", "x"))


def test_schedule_rejects_non_requests(make_queue):
    with pytest.raises(TypeError, match="expects an AsyncRequest"):
        make_queue(False).schedule_async_request(("not", "a", "request"))


def test_megatron_core_request_runs_on_our_queue(make_queue, tmp_path):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest as McoreRequest

    finalized = []
    request = McoreRequest(
        fns.write_text, (str(tmp_path / "m"), None, "mcore"), [lambda: finalized.append(1)],
        preload_fn=functools.partial(str, "staged"),
    )
    queue = make_queue(True)
    queue.schedule_async_request(request)
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert (tmp_path / "m").read_text() == "mcore:staged"
    assert finalized == [1]


def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


# -- the hand-over: staging that continues after it is refused under another library's caller


def _hand_over_refused() -> bool:
    try:
        require_hand_over("overlapped staging", "save without overlap_staging")
    except StagingHandOverError:
        return True
    return False


def test_only_our_callers_preload_may_hand_over_and_the_mark_is_per_thread():
    seen = {}

    def preload():
        seen["inside"] = _hand_over_refused()
        other = threading.Thread(target=lambda: seen.setdefault("other thread", _hand_over_refused()))
        other.start()
        other.join()
        return run_preload(lambda: "nested")

    assert _hand_over_refused()
    assert run_preload(preload) == "nested"
    assert seen == {"inside": False, "other thread": True}
    assert _hand_over_refused()
    with pytest.raises(ZeroDivisionError):  # the mark ends when preload raises
        run_preload(lambda: 1 / 0)
    assert _hand_over_refused()


def test_outside_our_callers_the_refusal_names_the_queue_and_the_alternative():
    with pytest.raises(StagingHandOverError) as raised:
        require_hand_over("overlapped staging", "save without overlap_staging")
    message = str(raised.value)
    assert "megatron_async.AsyncCallsQueue" in message
    assert "save without overlap_staging" in message and "previous checkpoint is intact" in message
