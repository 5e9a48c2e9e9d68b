"""Bound the file-system steps of a save that run between two of its collectives.

Runs on the training thread. A save's commit has steps that only the coordinator (rank 0)
runs, each between two collectives on the coordination group: writing ``.metadata``,
megatron-core's ``metadata.json`` and manifest, the tracker file; a save's start has the
target checks every rank runs before its first collective. The other ranks wait in the
next collective, bounded by the coordination timeout, but the step itself had no bound:
on a hung network mount an ``fsync``, a ``rename`` or even an ``exists`` never returns,
the others time out, and that rank stays in the call for good, so the job never ends.

:func:`run_coordinator_step` runs such a step on a helper thread and waits for it at most
:func:`coordinator_step_timeout_s` (half the coordination timeout, so the rank reports the
failure while the others still wait for it, and every rank raises the same error instead
of a bare timeout; megatron-core's manifest step, which hashes every file, gets more). A
step that never returns is left behind on its daemon thread, which ends with the process.

A step left behind may still complete when the mount recovers. Ours write atomically
(temporary file, rename; megatron-core's manifest is a plain write), and a late
``.metadata`` describes data that every rank had already made durable, so it marks a
consistent checkpoint that the tracker does not name. Until it has returned, the path it
writes stays taken: a step names it (``path=``), :func:`steps_left_behind` lists the steps
still running on a path, and :func:`refuse_while_left_behind` refuses

* a new save into that checkpoint directory (our strategy's target check, the reference
  API's planning, the ``.metadata`` and ``metadata.json`` steps of the save that went on
  after a late unmarking, the manager's retry), so nothing late lands on newer data;
* a new tracker write (the manager, at a save's start and at its commit), so a late
  tracker write can never name an older checkpoint than a later commit did.

Callers name paths in one spelling (``normalize_checkpoint_path``: absolute, an object
URL without a trailing slash); they are compared as given, with no file-system call (the
file system is what hangs), so a second name of a directory through a link is not seen.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, List, Optional, Tuple, Type, TypeVar

from megatron_async.core import coordination
from megatron_async.errors import AsyncTimeoutError, CheckpointInProgressError

__all__ = [
    "CoordinatorStepTimeoutError",
    "DeadlineExpired",
    "FileSystemStepTimeoutError",
    "coordinator_step_timeout_s",
    "leave_behind",
    "refuse_while_left_behind",
    "run_coordinator_step",
    "run_with_deadline",
    "steps_left_behind",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class FileSystemStepTimeoutError(AsyncTimeoutError):
    """A bounded file-system step of a save did not return in time (any rank)."""


class CoordinatorStepTimeoutError(FileSystemStepTimeoutError):
    """A coordinator-only step of a save (a file-system call) did not return in time."""


class DeadlineExpired(TimeoutError):
    """:func:`run_with_deadline` stopped waiting: the call had not returned in time.

    Attributes:
        thread: the thread still running the call.
    """

    def __init__(self, message: str, thread: Optional[threading.Thread] = None) -> None:
        super().__init__(message)
        self.thread = thread


_left_behind_lock = threading.Lock()
_left_behind: List[Tuple[str, threading.Thread, str]] = []  # (path, thread, what)


def coordinator_step_timeout_s() -> float:
    """How long a coordinator-only step may take: half the coordination group's timeout
    (the group's, or the default one before any group exists)."""
    return coordination.coordination_timeout_s() / 2


def run_with_deadline(call: Callable[[], T], timeout_s: float, thread_name: str) -> T:
    """Run ``call`` on a daemon thread and wait at most ``timeout_s`` for it (any side).

    Returns what ``call`` returned, or raises what it raised.

    Raises:
        DeadlineExpired: ``call`` had not returned by then; its thread is left running.
    """
    outcome: dict = {}
    done, gave_up = threading.Event(), threading.Event()

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the waiting caller
            outcome["error"] = exc
            if gave_up.is_set():  # nobody reads it any more
                logger.warning("%s failed after its caller stopped waiting: %s", thread_name, exc)
        finally:
            done.set()

    thread = threading.Thread(target=run, name=thread_name, daemon=True)
    thread.start()
    try:
        finished = done.wait(timeout_s)
    except BaseException:  # an interrupt: nobody waits any more
        gave_up.set()
        raise
    if not finished:
        gave_up.set()
        raise DeadlineExpired(f"no answer within {timeout_s:.0f}s", thread)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def run_coordinator_step(
    what: str,
    step: Callable[[], T],
    timeout_s: Optional[float] = None,
    path: Optional[str] = None,
    error: Type[Exception] = CoordinatorStepTimeoutError,
    hint: str = "the file system is not answering (a hung network mount?); check the mount, then save again",
) -> T:
    """Run one file-system step of a save within its bound (the rank that runs it).

    Args:
        what: the step, for messages (e.g. ``"writing .metadata of /ckpt/iter_10"``).
        step: the step itself; it must be safe to complete after its caller gave up
            (see the module docstring).
        timeout_s: the bound; :func:`coordinator_step_timeout_s` by default.
        path: the checkpoint directory or file the step writes, normalized: if the step
            is left behind, :func:`steps_left_behind` names it there until it returns.
        error: what to raise when the step is left behind (a step that every rank runs
            raises :class:`FileSystemStepTimeoutError`).
        hint: what the message says is likely wrong and what to do.

    Returns:
        What ``step`` returned.

    Raises:
        CoordinatorStepTimeoutError: ``step`` did not return in time (or ``error``).
        Exception: whatever ``step`` raised.
    """
    bound_s = coordinator_step_timeout_s() if timeout_s is None else timeout_s
    try:
        return run_with_deadline(step, bound_s, f"save step: {what}")
    except DeadlineExpired as exc:
        logger.error("%s did not return within %gs; leaving it behind", what, bound_s)
        if path is not None and exc.thread is not None:
            leave_behind(path, exc.thread, what)
        raise error(f"{what} did not return within {bound_s:g}s: {hint}") from exc


def leave_behind(path: str, thread: threading.Thread, what: str) -> None:
    """Keep ``path`` taken while ``thread`` runs a step on it that nobody waits for (any
    rank): :func:`steps_left_behind` names it there as ``what`` until the thread ends."""
    with _left_behind_lock:
        _left_behind.append((os.fspath(path), thread, what))


def steps_left_behind(path: str) -> List[str]:
    """The steps left behind on ``path`` that still run (this process; no file-system call).

    Args:
        path: a checkpoint directory or file, normalized as the steps named it.

    Returns:
        What each such step does, oldest first; steps that have returned are forgotten.
    """
    key = os.fspath(path)
    with _left_behind_lock:
        _left_behind[:] = [entry for entry in _left_behind if entry[1].is_alive()]
        return [what for where, _, what in _left_behind if where == key]


def refuse_while_left_behind(
    path: str,
    error: Type[Exception] = CheckpointInProgressError,
    hint: str = "check the mount, then save again (into another directory if it never recovers)",
) -> None:
    """Raise ``error`` if a step left behind still writes ``path`` (the rank that left it).

    Args:
        path: the checkpoint directory or tracker file, normalized.
        error: the error to raise.
        hint: what to do, for the message (which also names the step).
    """
    stuck = steps_left_behind(path)
    if stuck:
        raise error(
            f"{stuck[0]} (an earlier step that did not return in time) is still running: "
            f"{path} stays taken until it returns, so that it cannot land over a newer "
            f"write; {hint}"
        )
