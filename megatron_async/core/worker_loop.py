"""The persistent worker's main loop (runs in the background process only).

Protocol, trainer -> worker (a multiprocessing queue):
    ``(call_idx, encoded_request, cuda_device)``: map the request's new shared-memory
    segments, unpickle it (see :mod:`megatron_async.core.request_transport`; its data
    is already staged by the trainer), acknowledge, then write;
    ``STOP``: finish the writes already accepted, say ``stopped`` and exit.
Worker -> trainer (a one-way pipe, so a worker dying mid-message reads as EOF, never as
a hang): ``("ready", None)`` once at start-up, ``("received", idx)``, ``("done", idx)``,
``("error", idx, RankFailure)``, ``("stopped", None)``.

Receiving and writing run on different threads, so a second request is taken while the
first is still being written.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, Optional

from megatron_async.core.process_lifetime import (
    parent_is_alive,
    raise_open_file_limit,
    set_parent_death_signal,
)
from megatron_async.core.request_transport import DESCRIPTOR_TIMEOUT_S, SegmentTable
from megatron_async.errors import RankFailure

__all__ = ["STOP", "persistent_worker_main"]

STOP = "STOP"

logger = logging.getLogger(__name__)

_PARENT_CHECK_INTERVAL_S = 1.0


class _Reporter:
    """Sends messages to the trainer from both worker threads (background side)."""

    def __init__(self, conn):
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, kind: str, call_idx: Optional[int], payload: Any = None) -> None:
        message = (kind, call_idx) if payload is None else (kind, call_idx, payload)
        with self._lock:
            self._conn.send(message)


def _write_loop(rank: int, jobs: "queue.Queue", reporter: _Reporter) -> None:
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
            SegmentTable.drop(call_segments)
            reporter.send("error", call_idx, failure)
        else:
            del job, fn, args, kwargs
            SegmentTable.drop(call_segments)
            reporter.send("done", call_idx)


def persistent_worker_main(
    rank: int,
    requests,
    result_conn,
    descriptor_socket,
    parent_pid: int,
    log_level: int,
    cuda_device: Optional[int],
) -> None:
    """Entry point of the persistent worker process (background side).

    Args:
        rank: the trainer's global rank (for messages).
        requests: queue of ``(call_idx, encoded_request, cuda_device)`` or ``STOP``.
        result_conn: sending end of the pipe to the trainer.
        descriptor_socket: the worker's end of the socket that carries segment descriptors.
        parent_pid: the trainer's pid; the worker exits when the trainer is gone.
        log_level: the trainer's logging level.
        cuda_device: device to make current, when the trainer uses CUDA.
    """
    set_parent_death_signal()
    raise_open_file_limit()  # every mapped shared-memory segment keeps one descriptor
    logging.basicConfig(level=log_level)
    if cuda_device is not None:
        import torch

        torch.cuda.set_device(cuda_device)
    reporter = _Reporter(result_conn)
    descriptor_socket.settimeout(DESCRIPTOR_TIMEOUT_S)
    table = SegmentTable(descriptor_socket)
    jobs: "queue.Queue" = queue.Queue()
    writer = threading.Thread(target=_write_loop, args=(rank, jobs, reporter), daemon=True)
    writer.start()
    reporter.send("ready", None)
    logger.debug("rank %d worker %d: started", rank, os.getpid())
    while True:
        try:
            message = requests.get(timeout=_PARENT_CHECK_INTERVAL_S)
        except queue.Empty:
            if not parent_is_alive(parent_pid):
                logger.warning("rank %d worker: trainer %d is gone; exiting", rank, parent_pid)
                os._exit(1)
            continue
        if message == STOP:
            jobs.put(None)
            writer.join()
            reporter.send("stopped", None)
            return
        call_idx, encoded, request_device = message
        try:
            if request_device is not None:
                import torch

                torch.cuda.set_device(request_device)
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
