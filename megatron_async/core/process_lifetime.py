"""Process lifetime helpers shared by the callers (trainer side and background side).

No background process outlives its trainer or hangs its exit: the kernel kills it when
the trainer dies (:func:`enter_background`), and the trainer kills what is left at
interpreter exit (:func:`abort_at_exit`).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing.process
import os
import signal
import weakref
from typing import Optional

import psutil

__all__ = ["enter_background", "describe_exit", "kill_and_reap", "abort_at_exit"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

REAP_AFTER_KILL_S = 5.0
"""How long :func:`kill_and_reap` waits, by default, for a killed process to be gone.
Internal, not a user's bound: SIGKILL ends a process at once unless it is stuck in
uninterruptible I/O (a hung mount), where waiting longer would only stall the trainer;
a caller's ``close()`` passes its ``close_timeout_s`` instead."""


def enter_background(parent_pid: int, nice_increment: int) -> None:
    """Tie this forked process to its trainer and lower its CPU priority (background side).

    Call it first thing in the child, before any thread starts: Linux sends SIGKILL here
    when the trainer dies (``PR_SET_PDEATHSIG``; a trainer gone before that exits at
    once), and every thread started later inherits the nice value
    (``AsyncCallerConfig.writer_nice_increment``); the trainer is never touched.
    """
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
    if nice_increment:
        try:
            os.nice(nice_increment)
        except OSError as exc:  # the write goes on at the trainer's priority
            logger.debug("cannot lower the writer's CPU priority: %s", exc)


def describe_exit(exitcode: Optional[int]) -> str:
    """How a background process ended, for messages: "was killed by signal 9", "exited with code 1"."""
    if exitcode is not None and exitcode < 0:
        return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def kill_and_reap(process, join_timeout_s: float = REAP_AFTER_KILL_S) -> None:
    """SIGKILL a background process (and its children) and join it, bounded.

    Runs on the trainer. Children are killed too because a background writer may have
    started I/O processes of its own (megatron-core's writer does).
    """
    pid = process.pid
    if pid is not None and process.is_alive():
        try:
            for child in psutil.Process(pid).children(recursive=True):
                try:
                    child.kill()
                except psutil.Error:
                    pass
        except psutil.Error as exc:  # best effort: the process is already gone
            logger.debug("could not list children of pid %s: %s", pid, exc)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.join(timeout=join_timeout_s)
    if process.is_alive():  # not even SIGKILL ends it: uninterruptible I/O (a hung mount)
        logger.error(
            "background process %s did not end within %.0fs of SIGKILL (stuck in uninterruptible "
            "I/O, e.g. on a hung file system); it is left behind, and not waited for at exit",
            pid, join_timeout_s,
        )
        # multiprocessing's exit hook joins every child it knows, without a bound
        multiprocessing.process._children.discard(process)


# Per process, like the atexit hook that reads it: every live caller of the interpreter.
_live_callers: "weakref.WeakSet" = weakref.WeakSet()


def abort_at_exit(caller) -> None:
    """Call ``caller._abort_at_exit()`` at interpreter exit if ``caller`` is still alive.

    Runs on the trainer. Held weakly, so a collected caller is simply skipped. Our
    atexit hook is registered after multiprocessing's, so it runs first (atexit is LIFO)
    and the processes are gone before multiprocessing's hook joins them, unboundedly.
    """
    _live_callers.add(caller)


@atexit.register
def _abort_live_callers() -> None:
    for caller in list(_live_callers):
        try:
            caller._abort_at_exit()
        except Exception as exc:  # best effort at exit; keep cleaning the others
            logger.warning("async checkpoint cleanup at exit failed: %s", exc)
