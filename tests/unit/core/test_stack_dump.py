"""Stacks of a timed-out writer (core/stack_dump.py): asked for before the kill, bounded."""

import multiprocessing as mp
import os
import signal
import time

from megatron_async.core import stack_dump


def _stuck_in_a_stalled_write(ready):
    stack_dump.arm()
    ready.set()
    time.sleep(600)


def _unarmed_sleeper(ready):
    ready.set()
    time.sleep(600)


def _start(target):
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    process = ctx.Process(target=target, args=(ready,), daemon=True)
    process.start()
    assert ready.wait(30)
    return process


def test_an_armed_writer_reports_where_it_is_stuck_and_the_file_goes_with_it():
    process = _start(_stuck_in_a_stalled_write)
    try:
        stacks = stack_dump.collect(process.pid)
        assert stacks is not None and "in _stuck_in_a_stalled_write" in stacks, stacks
        assert process.is_alive(), "asking for the stacks must not end the writer"
        tail = stack_dump.message_tail(stacks)
        assert tail.startswith("\nWhere the writer's threads were") and "_stuck_in" in tail
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
    stack_dump.forget(process.pid)
    assert stack_dump.collect(process.pid) is None


def test_an_unarmed_process_is_not_signalled():
    process = _start(_unarmed_sleeper)
    try:
        started = time.monotonic()
        assert stack_dump.collect(process.pid) is None
        assert time.monotonic() - started < 1.0
        time.sleep(0.2)
        assert process.is_alive(), "the dump signal's default action would have killed it"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)


def test_the_tail_is_empty_without_stacks_and_bounded_with_them():
    assert stack_dump.message_tail(None) == ""
    many = "Thread 0x1 (most recent call first):\n" + "".join(
        f'  File "f.py", line {i} in frame{i}\n' for i in range(50))
    tail = stack_dump.message_tail(many, frames_per_thread=3)
    assert "frame0" in tail and "frame2" in tail and "frame3" not in tail and tail.endswith("  ...")
    assert len(stack_dump.message_tail(many * 100, limit=500)) < 700
