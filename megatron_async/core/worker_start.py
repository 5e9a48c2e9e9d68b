"""Start the persistent worker and explain a failed start (trainer side).

:class:`~megatron_async.core.persistent.PersistentAsyncCaller` starts a worker when it
is created and again for the save after its worker died or was killed. The worker is a
fork of the trainer (:mod:`megatron_async.core.worker_fork`) where the configuration
asks for one and the trainer can fork it, otherwise a fresh interpreter
(:mod:`megatron_async.core.worker_process`). A worker that exits, or is not ready within
``staging_timeout_s``, while starting is reported with :func:`startup_failure_message`.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

import torch

from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.request_transport import DESCRIPTOR_TIMEOUT_S
from megatron_async.core.worker_fork import can_fork_worker, fork_worker_process
from megatron_async.core.worker_process import WORKER_MODULE, WorkerProcess, start_worker_process
from megatron_async.errors import WorkerDiedError

__all__ = ["current_cuda_device", "start_worker", "startup_failure_message"]

logger = logging.getLogger(__name__)


def current_cuda_device() -> Optional[int]:
    """The trainer's current CUDA device, or None where CUDA is not in use (trainer side)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def start_worker(rank: int, config: AsyncCallerConfig) -> WorkerProcess:
    """Start the persistent worker of ``rank`` by fork or exec; return at once (trainer side).

    A fork that fails falls back to a fresh interpreter, with a warning.

    Raises:
        WorkerDiedError: the fresh interpreter could not be started either.
    """
    log_level = logging.getLogger().getEffectiveLevel()
    priority = config.writer_priority.to_options()
    process: Optional[WorkerProcess] = None
    if config.worker_start == "fork" and can_fork_worker():
        try:
            process = fork_worker_process(rank, log_level, priority)
        except WorkerDiedError as exc:
            logger.warning("%s; starting a fresh interpreter instead", exc)
    if process is None:
        process = start_worker_process(rank, log_level, current_cuda_device(), priority)
    process.descriptor_socket.settimeout(DESCRIPTOR_TIMEOUT_S)
    return process


def startup_failure_message(what: str, output: str, forked: bool = False) -> str:
    """Say why a worker did not start, with its stderr, and what to check."""
    if forked:  # its traceback went straight to the trainer's stderr
        return (
            f"{what}. The worker was a fork of this process; its traceback, if any, is on "
            "this process's stderr. Start it as a fresh interpreter instead "
            "(AsyncCallerConfig(worker_start='exec')), or use the temporal caller "
            "(AsyncCallsQueue(persistent=False))."
        )
    said = (
        "Its stderr while starting:\n    " + "\n    ".join(output.splitlines())
        if output
        else "It wrote nothing to stderr."
    )
    return (
        f"{what}. {said}\nThe worker is a fresh interpreter ({sys.executable}) that imports "
        f"{WORKER_MODULE} with this process's sys.path; check that "
        f"`{sys.executable} -c 'import {WORKER_MODULE}'` works in this environment, or use "
        "the temporal caller (AsyncCallsQueue(persistent=False))."
    )
