"""Where a timed-out background writer was stuck: its Python stacks, asked for before the kill.

A writer killed for running past ``timeout_s`` used to leave only "it took too long". Now
the failing rank logs where each of its threads was (a write blocked on a stalled file
system, a lock never released), and the error every rank raises names each thread's
innermost frame on its one line.

Trainer side: :func:`prepare` makes, once per trainer process, a private folder (0700)
that the writers it starts inherit through the environment; :func:`collect` sends
:data:`DUMP_SIGNAL` to its own writer (a child it has not reaped, so the pid is its
writer's) and waits a bounded moment for the stacks; :func:`forget` removes a finished
writer's file. Background side: :func:`arm`, first thing in the forked child of a
temporal call and in the persistent worker, has :mod:`faulthandler` write every thread's
stack to the writer's own file on that signal; :func:`disarm` undoes it on a normal exit.
A writer in an uninterruptible system call (a hung NFS server) cannot run the handler
until the call returns: :func:`collect` then gives up after its wait and returns None.
Where the platform has no real-time signals, all of this is a no-op.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from typing import List, Optional

__all__ = ["DUMP_SIGNAL", "prepare", "arm", "disarm", "collect", "forget", "innermost_frames",
           "timeout_note"]

logger = logging.getLogger(__name__)

_RTMIN = getattr(signal, "SIGRTMIN", None)
DUMP_SIGNAL = None if _RTMIN is None else _RTMIN + 7
"""The signal that asks an armed writer for its stacks (a Linux real-time signal nobody
else sends: SIGUSR1/2 keep their meaning); None where there is none."""

COLLECT_WAIT_S = 2.0
"""How long :func:`collect` waits for the stacks."""

_FOLDER_ENV = "MEGATRON_ASYNC_STACK_DIR"
# Per-process facts, shared with children through the environment and a signal handler:
# the trainer's one stack folder, and this writer's armed handler.
_folder: Optional[str] = None
_armed: Optional[tuple] = None  # (stream, path) of this writer


def _stack_file(folder: str, pid: int) -> str:
    return os.path.join(folder, f"{pid}.txt")


def prepare() -> Optional[str]:
    """The folder this trainer's writers write their stacks to (trainer side; made once).

    Call before starting a writer: the writer finds it in its inherited environment.
    """
    global _folder
    if DUMP_SIGNAL is None:
        return None
    if _folder is None or not os.path.isdir(_folder):
        try:
            _folder = tempfile.mkdtemp(prefix="megatron_async_stacks.")
        except OSError as exc:
            logger.debug("no stack dumps of timed-out writers: %s", exc)
            return None
        atexit.register(shutil.rmtree, _folder, True)
    os.environ[_FOLDER_ENV] = _folder
    return _folder


def arm() -> None:
    """Dump this writer's stacks on :data:`DUMP_SIGNAL` (background side; best effort)."""
    global _armed
    folder = os.environ.get(_FOLDER_ENV)
    if DUMP_SIGNAL is None or not folder:
        return
    path = _stack_file(folder, os.getpid())
    try:
        if os.path.lexists(path):  # left by a dead writer whose pid this one reuses
            os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        logger.debug("no stack dump on timeout for pid %d: %s", os.getpid(), exc)
        return
    stream = os.fdopen(fd, "w")
    try:
        faulthandler.register(DUMP_SIGNAL, file=stream, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError) as exc:
        logger.debug("no stack dump on timeout for pid %d: %s", os.getpid(), exc)
        stream.close()
        os.unlink(path)
        return
    _armed = (stream, path)


def disarm() -> None:
    """Undo :func:`arm` (background side, at a normal exit).

    The file goes first, so that the trainer no longer signals this process; then the
    signal is ignored rather than restored to its default action, which would end it.
    """
    global _armed
    armed, _armed = _armed, None
    if armed is None:
        return
    stream, path = armed
    try:
        os.unlink(path)
    except OSError:
        pass
    if threading.current_thread() is threading.main_thread():
        signal.signal(DUMP_SIGNAL, signal.SIG_IGN)


def forget(pid: int) -> None:
    """Remove the stack file of the finished writer ``pid``, if any (trainer side)."""
    if _folder is not None:
        try:
            os.unlink(_stack_file(_folder, pid))
        except OSError:
            pass


def collect(pid: int, wait_s: float = COLLECT_WAIT_S) -> Optional[str]:
    """Ask this trainer's armed writer ``pid`` for its stacks; return them, or None.

    Trainer side, on a writer it started and has not reaped. Bounded by ``wait_s``. Only a
    writer that armed itself is signalled: its file exists only while it is armed.
    """
    if _folder is None:
        return None
    path = _stack_file(_folder, pid)
    try:
        before = os.path.getsize(path)
        os.kill(pid, DUMP_SIGNAL)
    except OSError:
        return None
    deadline = time.monotonic() + wait_s
    size, text = before, ""
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            with open(path) as stream:
                stream.seek(before)
                text = stream.read()
        except OSError:
            return None
        if text and before + len(text) == size:  # written, and nothing more in 50 ms
            break
        size = before + len(text)
    return text or None


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<name>\S+)')


def innermost_frames(stacks: Optional[str], limit: int = 300) -> str:
    """Each thread's innermost frame, ``name (file:line)``, on one line of at most
    ``limit`` characters; '' without stacks."""
    if not stacks:
        return ""
    frames: List[str] = []
    expect_frame = False
    for line in stacks.splitlines():
        if not line.startswith(" "):
            expect_frame = line.strip().endswith("(most recent call first):")
            continue
        match = _FRAME.match(line)
        if expect_frame and match:
            frames.append(f"{match['name']} ({os.path.basename(match['file'])}:{match['line']})")
            expect_frame = False
    text = " | ".join(frames)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def timeout_note(rank: int, pid: Optional[int]) -> str:
    """For a writer about to be killed for its timeout (trainer side): collect its stacks,
    log them on this rank, and return what the error's one line adds ('' without them)."""
    stacks = collect(pid) if pid is not None else None
    if not stacks:
        return ""
    logger.error("rank %d: where the timed-out writer (pid %d) was, most recent call first:\n%s",
                 rank, pid, stacks.rstrip())
    return f"; its threads were in: {innermost_frames(stacks)} (stacks in rank {rank}'s log)"
