"""A tiny 'trainer' for process-cleanup tests: schedules a save that never ends, then
exits in the way named on the command line (normal, raise, sigkill)."""

import os
import signal
import sys
import time

from megatron_async.core import AsyncCallsQueue, AsyncRequest
from tests import background_fns as fns
from tests.persistent_worker import wait_until_worker_ready


def main(persistent: bool, how: str, pid_file: str) -> None:
    queue = wait_until_worker_ready(AsyncCallsQueue(persistent=persistent))
    queue.schedule_async_request(AsyncRequest(fns.record_pid_and_hang, (pid_file, None, 600.0), []))
    while not os.path.exists(pid_file):
        time.sleep(0.02)
    if how == "raise":
        raise RuntimeError("trainer crashed")
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    # how == "normal": fall off the end without closing the queue


if __name__ == "__main__":
    main(sys.argv[1] == "persistent", sys.argv[2], sys.argv[3])
