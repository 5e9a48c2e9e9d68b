"""Where a timed-out background writer was stuck: its Python stacks, asked for before the kill.

The failing rank logs each thread's stack, and the error every rank raises names each
thread's innermost frame on its one line.

Trainer side: :func:`new_file`, just before forking a writer (the temporal caller's child,
the persistent worker), makes an anonymous file that the child inherits;
:func:`timeout_note`, just before the kill, asks the writer for its stacks there
(:func:`collect`). Background side: :func:`arm`, first thing in the child, has
:mod:`faulthandler` write every thread's stack to that file on :data:`DUMP_SIGNAL`. A
writer that has not armed itself yet is ended by the signal's default action, which the
kill that follows would do anyway; one in an uninterruptible system call (a hung NFS
server) cannot run the handler until the call returns. Either way the error goes without
stacks.
"""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import re
import signal
import time
from typing import Optional

__all__ = ["DUMP_SIGNAL", "new_file", "arm", "collect", "innermost_frames", "timeout_note"]

logger = logging.getLogger(__name__)

DUMP_SIGNAL = signal.SIGRTMIN + 7
"""The signal that asks an armed writer for its stacks (a Linux real-time signal nobody
else sends: SIGUSR1/2 keep their meaning)."""

COLLECT_WAIT_S = 2.0
"""How long :func:`collect` waits for the stacks."""


def new_file() -> Optional[io.FileIO]:
    """An anonymous file for the writer about to be forked (trainer side); None if unavailable.

    Closed when the caller drops it, once the writer is gone.
    """
    try:
        return io.FileIO(os.memfd_create("megatron-async-stacks"), "r+")
    except OSError as exc:
        logger.debug("no stack dumps of timed-out writers: %s", exc)
        return None


def arm(stack_file: Optional[io.FileIO]) -> None:
    """Dump this writer's stacks to ``stack_file`` on :data:`DUMP_SIGNAL` (background side; best effort)."""
    if stack_file is None:
        return
    try:
        faulthandler.register(DUMP_SIGNAL, file=stack_file.fileno(), all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError) as exc:
        logger.debug("no stack dump on timeout for pid %d: %s", os.getpid(), exc)


def collect(pid: int, stack_file: Optional[io.FileIO]) -> Optional[str]:
    """Ask the writer ``pid`` for its stacks in ``stack_file``; return them, or None.

    Trainer side, on a writer it forked with this file, has not reaped (so the pid is still
    the writer's) and kills next. Bounded by :data:`COLLECT_WAIT_S`; returns only what this
    request wrote.
    """
    if stack_file is None:
        return None
    fd = stack_file.fileno()
    try:
        before = os.fstat(fd).st_size
        os.kill(pid, DUMP_SIGNAL)
    except (OSError, ValueError):
        return None
    deadline = time.monotonic() + COLLECT_WAIT_S
    size, data = before, b""
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            data = os.pread(fd, os.fstat(fd).st_size - before, before)
        except (OSError, ValueError):
            return None
        if data and before + len(data) == size:  # written, and nothing more in 50 ms
            break
        size = before + len(data)
    return data.decode("utf-8", errors="replace") or None


# A thread's header line and its first (innermost) frame, as faulthandler writes them.
_INNERMOST = re.compile(r'\(most recent call first\):\n +File "([^"]*)", line (\d+) in (\S+)')


def innermost_frames(stacks: Optional[str], limit: int = 300) -> str:
    """Each thread's innermost frame, ``name (file:line)``, on one line of at most
    ``limit`` characters; '' without stacks."""
    frames = [
        f"{name} ({os.path.basename(path)}:{line})"
        for path, line, name in _INNERMOST.findall(stacks or "")
    ]
    text = " | ".join(frames)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def timeout_note(rank: int, pid: Optional[int], stack_file: Optional[io.FileIO]) -> str:
    """For a writer about to be killed for its timeout (trainer side): collect its stacks,
    log them on this rank, and return what the error's one line adds ('' without them)."""
    stacks = collect(pid, stack_file) if pid is not None else None
    if not stacks:
        return ""
    logger.error("rank %d: where the timed-out writer (pid %d) was, most recent call first:\n%s",
                 rank, pid, stacks.rstrip())
    return f"; its threads were in: {innermost_frames(stacks)} (stacks in rank {rank}'s log)"
