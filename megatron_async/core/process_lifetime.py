"""Process lifetime helpers shared by the callers (trainer side and background side).

Background processes must never outlive, or be outlived by, their trainer in a way
that hangs or leaks: they ask the kernel to kill them when the trainer dies, and the
trainer kills what is left of them at interpreter exit, before multiprocessing's own
exit hook would join (unboundedly) any non-daemon child.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import multiprocessing.process
import os
import signal
import threading
import weakref
from typing import Callable, Optional

__all__ = [
    "describe_exit",
    "raise_open_file_limit",
    "set_parent_death_signal",
    "parent_is_alive",
    "kill_and_reap",
    "register_exit_cleanup",
]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

REAP_AFTER_KILL_S = 5.0
"""How long :func:`kill_and_reap` waits, by default, for a killed process to be gone.
Internal, not a user's bound: SIGKILL ends a process at once unless it is stuck in
uninterruptible I/O (a hung mount), where waiting longer would only stall the trainer;
a caller's ``close()`` passes its ``close_timeout_s`` instead."""


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this (background) process when its parent dies.

    Runs in the background process. A no-op where prctl is unavailable; the worker
    loops also poll :func:`parent_is_alive` as a portable fallback.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable; relying on parent polling")


def raise_open_file_limit() -> int:
    """Lift this process's soft limit of open files to its hard limit; return the limit.

    Runs on the trainer and in the persistent worker: torch shares every CPU tensor
    storage sent to the worker through a file descriptor that stays open on both sides.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            logger.debug("cannot raise RLIMIT_NOFILE to %s: %s", hard, exc)
    return soft


def parent_is_alive(parent_pid: int) -> bool:
    """True while the process that started us is still our parent (background side)."""
    return os.getppid() == parent_pid


def describe_exit(exitcode: Optional[int]) -> str:
    """How a background process ended, for messages: "was killed by signal 9", "exited with code 1"."""
    if exitcode is not None and exitcode < 0:
        return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def kill_and_reap(process, join_timeout_s: float = REAP_AFTER_KILL_S) -> None:
    """SIGKILL a multiprocessing process (and its children) and join it, bounded.

    Runs on the trainer. Children are killed too because a background writer may have
    started I/O processes of its own.
    """
    if process is None:
        return
    pid = process.pid
    if pid is not None and process.is_alive():
        try:
            import psutil

            for child in psutil.Process(pid).children(recursive=True):
                try:
                    child.kill()
                except psutil.Error:
                    pass
        except Exception as exc:  # best effort: psutil missing or process already gone
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
        children = getattr(multiprocessing.process, "_children", None)
        if isinstance(children, set):
            children.discard(process)


# Per process, like the atexit hook that reads it: every live caller of the interpreter.
_cleanups: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_cleanup_lock = threading.Lock()
_next_cleanup_id = 0


def register_exit_cleanup(owner: object, method_name: str) -> None:
    """Call ``owner.<method_name>()`` at interpreter exit if ``owner`` is still alive.

    Runs on the trainer. Held weakly, so a collected caller is simply skipped. Our
    atexit hook is registered after multiprocessing's, so it runs first (atexit is LIFO)
    and the processes are gone before multiprocessing tries to join them.
    """
    global _next_cleanup_id
    with _cleanup_lock:
        _cleanups[_next_cleanup_id] = owner
        _next_cleanup_id += 1
    setattr(owner, "_exit_cleanup_method", method_name)


@atexit.register
def _run_exit_cleanups() -> None:
    with _cleanup_lock:
        owners = list(_cleanups.values())
        _cleanups.clear()
    for owner in owners:
        method: Optional[Callable[[], None]] = getattr(
            owner, getattr(owner, "_exit_cleanup_method", ""), None
        )
        if method is None:
            continue
        try:
            method()
        except Exception as exc:  # best effort at exit; keep cleaning the others
            logger.warning("async checkpoint cleanup at exit failed: %s", exc)
