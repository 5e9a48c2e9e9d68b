"""Where a timed-out background writer was stuck: its Python stacks, asked for before the kill.

A writer killed for running past ``timeout_s`` used to leave only "it took too long". Now
the error says where every one of its threads was: a write blocked on a stalled file
system, a lock never released, a collective of the writer's own.

Background side: :func:`arm`, first thing in the forked child of a temporal call and in
the persistent worker, has :mod:`faulthandler` write every thread's stack to a file of the
process's own when it receives :data:`DUMP_SIGNAL` (a real-time signal nobody else sends;
SIGUSR1/2 keep their meaning). Trainer side: :func:`collect` sends that signal to a
writer it is about to kill, waits a bounded moment for the stacks and returns them.
A writer in an uninterruptible system call (a hung NFS server) cannot run the handler
until the call returns: :func:`collect` then gives up after its wait and returns None.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import tempfile
import time
from typing import Optional

__all__ = ["DUMP_SIGNAL", "arm", "disarm", "collect", "forget", "message_tail"]

logger = logging.getLogger(__name__)

DUMP_SIGNAL = signal.SIGRTMIN + 7
"""The signal that asks an armed writer for its stacks (Linux real-time signal)."""

COLLECT_WAIT_S = 2.0
"""How long :func:`collect` waits for the stacks."""

_armed_stream = None


def _stack_file(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"megatron_async_stacks.{pid}.txt")


def arm() -> None:
    """Dump this process's stacks on :data:`DUMP_SIGNAL` (background side; best effort)."""
    global _armed_stream
    try:
        stream = open(_stack_file(os.getpid()), "w")
        faulthandler.register(DUMP_SIGNAL, file=stream, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError) as exc:
        logger.debug("no stack dump on timeout for pid %d: %s", os.getpid(), exc)
        return
    _armed_stream = stream


def disarm() -> None:
    """Undo :func:`arm` and remove the stack file (background side, at a normal exit)."""
    global _armed_stream
    stream, _armed_stream = _armed_stream, None
    if stream is None:
        return
    faulthandler.unregister(DUMP_SIGNAL)
    stream.close()
    forget(os.getpid())


def forget(pid: int) -> None:
    """Remove the stack file of ``pid``, if any (trainer side, once the writer is gone)."""
    try:
        os.unlink(_stack_file(pid))
    except OSError:
        pass


def collect(pid: int, wait_s: float = COLLECT_WAIT_S) -> Optional[str]:
    """Ask the armed writer ``pid`` for its stacks; return them, or None (trainer side).

    Bounded by ``wait_s``. Only a process that armed itself is signalled: the stack file
    exists only while it is armed, so an unarmed process (which the signal would kill) or
    a reused pid is left alone.
    """
    path = _stack_file(pid)
    if not os.path.exists(path):
        return None
    try:
        os.kill(pid, DUMP_SIGNAL)
    except OSError:
        return None
    deadline = time.monotonic() + wait_s
    size, text = -1, ""
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            with open(path) as stream:
                text = stream.read()
        except OSError:
            return None
        if text and len(text) == size:  # written, and nothing more came in 50 ms
            break
        size = len(text)
    return text or None


def message_tail(stacks: Optional[str], frames_per_thread: int = 8, limit: int = 4000) -> str:
    """What a timeout error appends: each thread's innermost frames, or '' without stacks.

    faulthandler lists every thread's frames most recent first; the innermost ones say
    where it is stuck, so each thread keeps its header and first ``frames_per_thread``
    frames, and the whole keeps its first ``limit`` characters.
    """
    if not stacks:
        return ""
    kept, frames = [], 0
    for line in stacks.strip().splitlines():
        if not line.startswith(" "):  # "Thread 0x... (most recent call first):"
            kept.append(line)
            frames = 0
            continue
        frames += 1
        if frames <= frames_per_thread:
            kept.append(line)
        elif frames == frames_per_thread + 1:
            kept.append("  ...")
    text = "\n".join(kept)
    if len(text) > limit:
        text = text[:limit] + "\n  ..."
    return f"\nWhere the writer's threads were when it was stopped:\n{text}"
