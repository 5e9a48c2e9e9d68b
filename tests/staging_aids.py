"""Test aids for staging: copies after the hand-over (overlapped, or in rounds) held back or
observed, and the process's cached staging buffers forgotten between tests."""

import contextlib
import threading
from unittest import mock

from megatron_async.core.device_wait import release_landed
from megatron_async.staging.budget import StagingBufferCache
from megatron_async.staging.overlapped import CopyJob, CopyThread


def staging_in_progress() -> bool:
    """Whether a copy job of this process (overlapped, or a later round) is still running."""
    return bool(CopyThread.of_process().pending())


def forget_staging_buffers() -> None:
    """Start from no cached staging buffers in this process, lent ones included (their
    holders keep them valid), and no host memory kept for landed device copies."""
    StagingBufferCache._process = None  # the next of_process() makes a fresh cache
    release_landed()


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
