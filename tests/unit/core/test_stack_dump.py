"""Stacks of a writer about to time out (core/caller.py's run_call): written by the writer
itself to its stderr at the due time, also while it is stuck in a blocking system call."""

import multiprocessing as mp
import os
import signal
import time

from megatron_async.core.caller import run_call, stacks_due


def _stuck_reading_a_pipe_that_never_gets_data(read_fd):
    os.read(read_fd, 1)


def _run_with_stderr_to(log_path, fn, args, due, linger_s):
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), 2)
    run_call(3, 7, fn, args, {}, due)
    time.sleep(linger_s)
    os._exit(0)


def _start(log_path, fn, args, due, linger_s=0.0):
    process = mp.get_context("fork").Process(
        target=_run_with_stderr_to, args=(log_path, fn, args, due, linger_s), daemon=True)
    process.start()
    return process


def test_a_writer_stuck_in_a_blocking_call_writes_its_stacks_at_the_due_time(tmp_path):
    log_path = tmp_path / "stderr"
    read_fd, write_fd = os.pipe()
    started = time.monotonic()
    due = started + 1.0
    process = _start(log_path, _stuck_reading_a_pipe_that_never_gets_data, (read_fd,), due)
    try:
        log = ""
        while "_stuck_reading_a_pipe_that_never_gets_data" not in log:
            assert time.monotonic() - started < 30, log
            time.sleep(0.05)
            log = log_path.read_text() if log_path.exists() else ""
        assert time.monotonic() >= due, "written before the due time"
        assert "rank 3: async call 7 is about to time out" in log, log
        assert 'in _stuck_reading_a_pipe_that_never_gets_data' in log, log
        assert process.is_alive(), "writing the stacks must not end the writer"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        os.close(read_fd)
        os.close(write_fd)


def test_a_call_that_ends_in_time_writes_no_stacks(tmp_path):
    log_path = tmp_path / "stderr"
    due = time.monotonic() + 0.5
    process = _start(log_path, time.sleep, (0.1,), due, linger_s=1.0)  # alive past the due time
    process.join(30)
    assert process.exitcode == 0 and time.monotonic() > due
    assert log_path.read_text() == "", "a call that ended in time must cancel its dump"


def test_the_stacks_are_due_the_smaller_of_10_s_and_5_percent_before_the_timeout():
    assert stacks_due(100.0, 3600.0) == 100.0 + 3600.0 - 10.0
    assert stacks_due(100.0, 20.0) == 100.0 + 20.0 - 1.0
