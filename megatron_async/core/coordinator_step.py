"""Bound the coordinator's own file-system steps between two collectives of a save.

Runs on the coordinator rank (rank 0) only, on the training thread. A save's commit has
steps that only the coordinator runs, each between two collectives on the coordination
group: writing ``.metadata``, megatron-core's ``metadata.json`` and manifest, the tracker
file. The other ranks wait for it in the next collective, bounded by the coordination
timeout. The coordinator's own step had no bound: on a hung network mount an ``fsync``
or a ``rename`` never returns, the others time out, and rank 0 stays in that call for
good, so the job never ends.

:func:`run_coordinator_step` runs such a step on a helper thread and waits for it at most
:func:`coordinator_step_timeout_s` (half the coordination timeout, so the coordinator
reports the failure while the others still wait for it, and every rank raises the same
:class:`CoordinatorStepTimeoutError` instead of a bare timeout). A step that never
returns is left behind on its daemon thread, which ends with the process.

A step left behind may still complete when the mount recovers. Each writes its file
atomically (temporary file, rename), and a late ``.metadata`` describes data that every
rank had already made durable, so it marks a consistent checkpoint that the tracker does
not name. Not covered: the directory is free again at once, so a retry into the *same*
directory while the old step is still stuck could get the old ``.metadata`` over its new
data, and a late tracker write could name an older checkpoint than a later commit did.
Save into a new directory after such a failure (Megatron-LM's next iteration does).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional, TypeVar

from megatron_async.core import coordination
from megatron_async.errors import AsyncTimeoutError

__all__ = [
    "CoordinatorStepTimeoutError",
    "DeadlineExpired",
    "coordinator_step_timeout_s",
    "run_coordinator_step",
    "run_with_deadline",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CoordinatorStepTimeoutError(AsyncTimeoutError):
    """A coordinator-only step of a save (a file-system call) did not return in time."""


class DeadlineExpired(TimeoutError):
    """:func:`run_with_deadline` stopped waiting: the call had not returned in time."""


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
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the waiting caller
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=thread_name, daemon=True).start()
    if not done.wait(timeout_s):
        raise DeadlineExpired(f"no answer within {timeout_s:.0f}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def run_coordinator_step(what: str, step: Callable[[], T], timeout_s: Optional[float] = None) -> T:
    """Run one coordinator-only step of a save within its bound (coordinator).

    Args:
        what: the step, for messages (e.g. ``"writing .metadata of /ckpt/iter_10"``).
        step: the step itself; it must be safe to complete after its caller gave up
            (see the module docstring).
        timeout_s: the bound; :func:`coordinator_step_timeout_s` by default.

    Returns:
        What ``step`` returned.

    Raises:
        CoordinatorStepTimeoutError: ``step`` did not return in time.
        Exception: whatever ``step`` raised.
    """
    bound_s = coordinator_step_timeout_s() if timeout_s is None else timeout_s
    try:
        return run_with_deadline(step, bound_s, f"coordinator step: {what}")
    except DeadlineExpired as exc:
        logger.error("%s did not return within %gs; leaving it behind", what, bound_s)
        raise CoordinatorStepTimeoutError(
            f"{what} did not return within {bound_s:g}s (half the coordination timeout): "
            "the file system is not answering (a hung network mount?); check the mount, "
            "then save again"
        ) from exc
