"""The persistent worker's main loop (runs in the background process only).

The worker is a fork of the trainer (:mod:`megatron_async.core.worker_fork`) that runs
:func:`main` and never returns into the trainer's code.

Protocol over the control connection, trainer -> worker:
    ``(call_idx, encoded_request)``: map the request's new shared-memory
    segments, unpickle it (see :mod:`megatron_async.core.request_transport`; its data
    is already staged by the trainer), acknowledge, then write;
    ``STOP``: finish the writes already accepted and exit.
Worker -> trainer (a worker dying mid-message reads as EOF, never as a hang):
``("ready", None)`` once at start-up, ``("received", idx)``, ``("done", idx)``,
``("error", idx, RankFailure)``.

Receiving and writing run on different threads, so a second request is taken while the
first is still being written.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any, Dict, Optional

from megatron_async.core import stack_dump
from megatron_async.core.process_lifetime import enter_background
from megatron_async.core.request_receiver import SegmentTable
from megatron_async.errors import RankFailure

__all__ = ["STOP", "main"]

STOP = "STOP"

logger = logging.getLogger(__name__)


class _Reporter:
    """Sends messages to the trainer from both worker threads (background side)."""

    def __init__(self, conn):
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, kind: str, call_idx: Optional[int], payload: Any = None) -> None:
        message = (kind, call_idx) if payload is None else (kind, call_idx, payload)
        with self._lock:
            self._conn.send(message)


def _write_loop(rank: int, jobs: "queue.Queue", reporter: _Reporter, table: SegmentTable) -> None:
    """Writer thread: run each accepted request's ``async_fn`` in order."""
    while True:
        job = jobs.get()
        if job is None:
            return
        call_idx, fn, args, kwargs, call_segments = job
        try:
            if fn is not None:
                fn(*args, **kwargs)
        except BaseException as exc:  # reported; the worker stays up for the next save
            logger.error("rank %d worker: async call %d failed while writing: %s", rank, call_idx, exc)
            failure = RankFailure.from_exception(rank, "write", exc)
            del job, fn, args, kwargs
            table.drop(call_segments)
            reporter.send("error", call_idx, failure)
        else:
            del job, fn, args, kwargs
            table.drop(call_segments)
            reporter.send("done", call_idx)


def main(options: Dict[str, Any]) -> None:
    """Serve requests until ``STOP``: the entry point of the forked worker (worker side).

    Args:
        options: what :func:`~megatron_async.core.worker_process.start_worker` passes:
            ``rank`` (the trainer's global rank, for messages), ``parent_pid`` (the worker
            exits when the trainer is gone, and its descriptors are opened through
            ``/proc/<parent_pid>``), ``nice_increment``, the inherited descriptor
            ``control_fd`` (requests in, results out), and ``stack_file`` (see
            :mod:`~megatron_async.core.stack_dump`).
    """
    rank, parent_pid = options["rank"], options["parent_pid"]
    enter_background(parent_pid, options["nice_increment"])  # before any thread exists
    control = Connection(options["control_fd"])
    stack_dump.arm(options["stack_file"])
    reporter = _Reporter(control)
    table = SegmentTable(parent_pid)
    jobs: "queue.Queue" = queue.Queue()
    writer = threading.Thread(target=_write_loop, args=(rank, jobs, reporter, table), daemon=True)
    writer.start()
    reporter.send("ready", None)
    logger.debug("rank %d worker %d: started", rank, os.getpid())
    while True:
        try:
            message = control.recv()  # a trainer that dies kills this process (enter_background)
        except (EOFError, OSError):
            logger.warning("rank %d worker: the trainer closed the connection; exiting", rank)
            os._exit(1)
        if message == STOP:
            jobs.put(None)
            writer.join()
            return
        call_idx, encoded = message
        try:
            request = table.apply(encoded)
        except BaseException as exc:
            # The trainer now believes segments or plan items reached this worker that
            # may not have: finish the accepted writes and exit, so that the next save
            # starts a fresh worker with a fresh view of what was sent.
            logger.error("rank %d worker: cannot read async call %d: %s", rank, call_idx, exc)
            reporter.send("error", call_idx, RankFailure.from_exception(rank, "schedule", exc))
            jobs.put(None)
            writer.join()
            os._exit(1)
        reporter.send("received", call_idx)
        jobs.put(
            (
                call_idx,
                request.async_fn,
                request.async_fn_args,
                request.async_fn_kwargs or {},
                encoded.call_segments,
            )
        )
        del request, encoded
