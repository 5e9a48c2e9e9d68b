"""Test helper: wait until a queue's persistent worker has started (trainer side).

A fork is ready within milliseconds; tests that signal or inspect the worker wait for it
first, so that it has finished its set-up.
"""

import time

from megatron_async.core import AsyncCallsQueue

WORKER_START_TIMEOUT_S = 60.0
"""Generous for a fork on a busy 2-core machine."""


def wait_until_worker_ready(queue: AsyncCallsQueue) -> AsyncCallsQueue:
    """Return ``queue`` once its persistent worker is ready (no-op for a temporal queue).

    Raises:
        AssertionError: the worker was not ready within :data:`WORKER_START_TIMEOUT_S`.
    """
    caller = queue.persistent_caller
    if caller is None:
        return queue
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    while not caller.is_worker_ready():
        assert time.monotonic() < deadline, "the persistent worker did not start in time"
        time.sleep(0.05)
    return queue
