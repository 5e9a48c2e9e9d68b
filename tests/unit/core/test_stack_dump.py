"""Stacks of a timed-out writer (core/stack_dump.py): asked for before the kill, bounded."""

import multiprocessing as mp
import os
import signal
import time

from megatron_async.core import stack_dump


def _stuck_in_a_stalled_write(stack_file, ready, leave):
    stack_dump.arm(stack_file)
    ready.set()
    while not leave.is_set():
        time.sleep(0.01)
    os._exit(7)


def _start(target):
    stack_file = stack_dump.new_file()
    ctx = mp.get_context("fork")
    ready, leave = ctx.Event(), ctx.Event()
    process = ctx.Process(target=target, args=(stack_file, ready, leave), daemon=True)
    process.start()
    assert ready.wait(30)
    return process, stack_file, leave


def test_an_armed_writer_reports_where_it_is_stuck():
    process, stack_file, leave = _start(_stuck_in_a_stalled_write)
    try:
        stacks = stack_dump.collect(process.pid, stack_file)
        assert stacks is not None and "in _stuck_in_a_stalled_write" in stacks, stacks
        assert process.is_alive(), "asking for the stacks must not end the writer"
        again = stack_dump.collect(process.pid, stack_file)  # only what the second signal wrote
        assert again is not None and again.count("_stuck_in_a_stalled_write") == 1
        note = stack_dump.timeout_note(3, process.pid, stack_file)
        assert note.startswith("; its threads were in: ") and "\n" not in note
        assert "_stuck_in_a_stalled_write (test_stack_dump.py:" in note and "rank 3" in note
        leave.set()
        process.join(10)
        assert process.exitcode == 7
    finally:
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
            process.join(10)


def test_innermost_frames_take_each_threads_first_frame_on_one_bounded_line():
    stacks = (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/a/writer.py", line 10 in write_bucket\n'
        '  File "/a/loop.py", line 5 in run\n'
        "\n"
        "Current thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/a/main.py", line 3 in wait_for_workers\n'
        '  File "/a/main.py", line 1 in <module>\n'
    )
    assert stack_dump.innermost_frames(stacks) == (
        "write_bucket (writer.py:10) | wait_for_workers (main.py:3)")
    assert stack_dump.innermost_frames(None) == ""
    assert len(stack_dump.innermost_frames(stacks * 50, limit=80)) == 80
