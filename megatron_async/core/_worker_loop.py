"""The persistent worker's main loop (runs in the background process only).

Protocol, trainer -> worker (a multiprocessing queue):
    ``(call_idx, pickled_request, cuda_device)``: stage the request's data (on that CUDA
    device, when the trainer uses one), acknowledge, then write;
    ``STOP``: finish the writes already accepted, say ``stopped`` and exit.
Worker -> trainer (a one-way pipe, so a worker dying mid-message reads as EOF, never as
a hang): ``("staged", idx)``, ``("done", idx)``, ``("error", idx, RankFailure)``,
``("stopped", None)``.

Staging and writing run on different threads: the trainer waits only for staging, so a
second save can be staged while the first is still being written.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
from typing import Any, Optional

from megatron_async.core._process import (
    parent_is_alive,
    raise_open_file_limit,
    set_parent_death_signal,
)
from megatron_async.core.request import STAGED_ARG_INDEX
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
        call_idx, fn, args, kwargs = job
        try:
            if fn is not None:
                fn(*args, **kwargs)
        except BaseException as exc:  # reported; the worker stays up for the next save
            logger.error("rank %d worker: async call %d failed while writing: %s", rank, call_idx, exc)
            reporter.send("error", call_idx, RankFailure.from_exception(rank, "write", exc))
        else:
            reporter.send("done", call_idx)
        finally:
            del job, fn, args, kwargs


def own_copy_of_shared_tensors(obj: Any) -> Any:
    """Copy every CPU tensor of ``obj`` that still lives in the trainer's shared memory.

    Tensors reach the worker as shared-memory views of the trainer's own storage. A
    staging function that does not copy CPU tensors (megatron-core's ``preload_tensors``
    calls ``tensor.to("cpu")``, which returns the same tensor) would hand the writer
    memory that the trainer modifies as soon as it hears "staged". Lists and dicts are
    updated in place (keeping subclasses and their attributes); tuples are rebuilt.
    """
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.device.type == "cpu" and obj.is_shared() else obj
    if isinstance(obj, list):
        for i, value in enumerate(obj):
            obj[i] = own_copy_of_shared_tensors(value)
        return obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = own_copy_of_shared_tensors(value)
        return obj
    if isinstance(obj, tuple):
        items = [own_copy_of_shared_tensors(value) for value in obj]
        if all(new is old for new, old in zip(items, obj)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def persistent_worker_main(
    rank: int,
    requests,
    result_conn,
    parent_pid: int,
    log_level: int,
    cuda_device: Optional[int],
) -> None:
    """Entry point of the persistent worker process (background side).

    Args:
        rank: the trainer's global rank (for messages).
        requests: queue of ``(call_idx, pickled_request, cuda_device)`` or ``STOP``.
        result_conn: sending end of the pipe to the trainer.
        parent_pid: the trainer's pid; the worker exits when the trainer is gone.
        log_level: the trainer's logging level.
        cuda_device: device to make current, when the trainer uses CUDA.
    """
    set_parent_death_signal()
    raise_open_file_limit()  # received tensor storages keep one descriptor each
    logging.basicConfig(level=log_level)
    if cuda_device is not None:
        import torch

        torch.cuda.set_device(cuda_device)
    reporter = _Reporter(result_conn)
    jobs: "queue.Queue" = queue.Queue()
    writer = threading.Thread(target=_write_loop, args=(rank, jobs, reporter), daemon=True)
    writer.start()
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
        call_idx, payload, request_device = message
        try:
            if request_device is not None:
                import torch

                torch.cuda.set_device(request_device)
            request = pickle.loads(payload)
            del payload
            args = list(request.async_fn_args)
            if request.preload_fn is not None:
                staged = own_copy_of_shared_tensors(request.preload_fn())
                if len(args) > STAGED_ARG_INDEX:
                    args[STAGED_ARG_INDEX] = staged
                del staged
        except BaseException as exc:
            logger.error("rank %d worker: staging of async call %d failed: %s", rank, call_idx, exc)
            reporter.send("error", call_idx, RankFailure.from_exception(rank, "staging", exc))
            continue
        reporter.send("staged", call_idx)
        jobs.put((call_idx, request.async_fn, args, request.async_fn_kwargs or {}))
        del request, args
