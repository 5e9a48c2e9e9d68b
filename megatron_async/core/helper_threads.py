"""Threads of ours that never end: bounded calls (a file-system or object-store request
that may never return on a hung mount) and long jobs (the persistent worker's sender) run
on helper threads that outlive them (any side).

A helper thread that finished its call waits for the next one instead of ending. A
thread that starts or ends at the moment another thread forks can leave the forked child
deadlocked before it runs a line of Python (CPython gh-112275: the child inherits the
interpreter's thread-list lock held), and our saves fork right after such calls (the
temporal caller's writer, a replacement persistent worker right after its predecessor's
sender stopped). With threads that neither start nor end once made, that window is gone.
A thread left behind in a call that never returned is simply not reused; the next call
gets a new thread, so the pool grows only by the calls that hung (after which
:class:`~megatron_async.core.save_directories.SaveDirectories` stops the process's saves
anyway) and by the most calls ever run at once. ``HelperThreads.of_process()`` is the
process's one pool.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from typing import Any, Callable, Dict, List, Tuple, TypeVar

from megatron_async.core.one_per_process import OnePerProcess

__all__ = ["DeadlineExpired", "HelperThreads"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_Job = Tuple[Callable[[], None], threading.Event, str]

_IDLE_NAME = "megatron-async-helper (idle)"


class DeadlineExpired(TimeoutError):
    """:meth:`HelperThreads.run` stopped waiting: the call had not returned in time."""


class HelperThreads(OnePerProcess):
    """Daemon threads that run bounded calls, each kept for the next call once it is done.

    Per-thread attributes (capabilities, CPU affinity, niceness, the signal mask) are
    copied from the creating thread when a thread starts: a thread made before the
    process changed its own keeps the old ones.
    """

    fresh_in_forked_child = True  # the parent's threads are not in the child

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: List["queue.SimpleQueue[_Job]"] = []

    def run(self, call: Callable[[], T], timeout_s: float, thread_name: str) -> T:
        """Run ``call`` on a helper thread and wait at most ``timeout_s`` for it.

        Returns what ``call`` returned, or raises what it raised.

        Raises:
            DeadlineExpired: ``call`` had not returned by then; its thread is left in it
                (and logs the outcome, since nobody reads it any more).
        """
        outcome: Dict[str, Any] = {}
        gave_up = threading.Event()

        def job() -> None:
            try:
                outcome["value"] = call()
            except BaseException as exc:  # handed to the waiting caller
                outcome["error"] = exc
                if gave_up.is_set():
                    logger.warning("%s failed after its caller stopped waiting: %s", thread_name, exc)

        done = self.start(job, thread_name)
        try:
            finished = done.wait(timeout_s)
        except BaseException:  # an interrupt: nobody waits any more
            gave_up.set()
            raise
        if not finished:
            gave_up.set()
            raise DeadlineExpired(f"no answer within {timeout_s:.0f}s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def start(self, call: Callable[[], None], thread_name: str) -> threading.Event:
        """Run ``call`` on a helper thread without waiting for it; return an event set once
        it returned (an exception it raises is logged)."""
        done = threading.Event()
        self._inbox().put((call, done, thread_name))
        return done

    def _inbox(self) -> "queue.SimpleQueue[_Job]":
        with self._lock:
            if self._idle:
                return self._idle.pop()
            inbox: "queue.SimpleQueue[_Job]" = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                             name=_IDLE_NAME).start()
            return inbox

    def _serve(self, inbox: "queue.SimpleQueue[_Job]") -> None:
        while True:
            job, done, name = inbox.get()
            thread = threading.current_thread()
            thread.name = name  # what a stack dump shows it doing
            try:
                # A fresh context, as a fresh thread had: no context variable a job set
                # reaches the next one.
                contextvars.Context().run(job)
            except BaseException:  # a started job's own error: nobody else would see it
                logger.exception("%s failed", name)
            del job
            thread.name = _IDLE_NAME
            with self._lock:
                self._idle.append(inbox)  # idle before the caller hears: its next call reuses us
            done.set()
