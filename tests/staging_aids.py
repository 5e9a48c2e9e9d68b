"""A test aid for staging that copies after the hand-over (overlapped, or in rounds)."""

import contextlib
import threading
from unittest import mock

from megatron_async.staging.copy_job import CopyJob


@contextlib.contextmanager
def copies_held():
    """Copy jobs submitted inside this block start copying only when it exits, which makes
    "a tensor changed before it was copied" deterministic."""
    start = threading.Event()
    run = CopyJob.run

    def held_run(job):
        start.wait()
        run(job)

    with mock.patch.object(CopyJob, "run", held_run):
        try:
            yield
        finally:
            start.set()
