"""Start the persistent worker as a fresh interpreter (trainer side): :func:`exec_worker`.

:func:`megatron_async.core.worker_process.start_worker` uses it with
``AsyncCallerConfig(worker_start="exec")`` and where the trainer cannot fork the worker (a
live staging segment, a failed fork; :mod:`megatron_async.core.worker_fork` is the fork).
The interpreter is ``sys.executable -c <bootstrap>``: the bootstrap sets ``sys.path`` to the
trainer's and imports :data:`WORKER_MODULE`, nothing else, on a thread of lowered CPU
priority (:data:`STARTUP_NICENESS_INCREMENT`). It never runs the trainer's ``__main__``
module, so it behaves the same under ``torchrun``, ``python script.py`` (with or without an
``if __name__ == "__main__":`` guard), ``python -c``, stdin and notebooks
(multiprocessing's *spawn* re-imports ``__main__`` in the child and has no public switch to
skip that). The trainer's ``sys.path`` is passed explicitly, as spawn does, rather than
through ``PYTHONPATH``: the child finds the package where the trainer found it, even from a
source tree or under ``python -I``. Until the worker says it is ready, its stderr goes to an
unlinked temporary file, so a worker that cannot start is reported with its own words.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_async import BACKGROUND_WORKER_ENV
from megatron_async.errors import WorkerDiedError

__all__ = ["STARTUP_NICENESS_INCREMENT", "WORKER_MODULE", "current_cuda_device", "exec_worker"]

logger = logging.getLogger(__name__)

WORKER_MODULE = "megatron_async.core.worker_loop"

STARTUP_NICENESS_INCREMENT = 10
"""How much lower the CPU priority of a fresh worker's start-up (importing torch) is.

The imports run on a thread of their own whose niceness is raised (Linux sets it per
thread); the threads that then serve requests keep the trainer's priority, which an
unprivileged process could not restore once lowered. A contested CPU goes to training
first; the start-up takes the spare time (saves scheduled meanwhile do not wait for it).
"""

# The worker's imports run on a low-priority thread; an import error still ends the
# worker with its traceback on stderr (re-raised here), which the trainer reports.
_BOOTSTRAP = (
    "import json, os, sys, threading\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "options = json.loads(sys.argv[2])\n"
    "failures = []\n"
    "def import_worker():\n"
    "    try:\n"
    "        tid = threading.get_native_id()\n"
    "        niceness = os.getpriority(os.PRIO_PROCESS, tid) + options['startup_niceness_increment']\n"
    "        os.setpriority(os.PRIO_PROCESS, tid, min(niceness, 19))\n"
    "    except (AttributeError, OSError):\n"
    "        pass  # no per-thread priority here: start at the trainer's\n"
    "    try:\n"
    f"        import {WORKER_MODULE}\n"
    "    except BaseException as exc:\n"
    "        failures.append(exc)\n"
    "importer = threading.Thread(target=import_worker)\n"
    "importer.start()\n"
    "importer.join()\n"
    "if failures:\n"
    "    raise failures[0]\n"
    f"from {WORKER_MODULE} import main\n"
    "main(options)\n"
)


def current_cuda_device() -> Optional[int]:
    """The trainer's current CUDA device, or None where CUDA is not in use (trainer side)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def exec_worker(options: Dict[str, Any]) -> Tuple[subprocess.Popen, Optional[Any]]:
    """Start a fresh interpreter that serves as the worker; return it and its start-up log."""
    rank, executable = options["rank"], sys.executable
    if not executable:
        raise WorkerDiedError(
            f"rank {rank}: cannot start the persistent checkpoint worker: sys.executable is "
            "empty (an embedded interpreter?); use the temporal caller "
            "(AsyncCallsQueue(persistent=False))"
        )
    startup_log, trainer_stderr = _capture_startup_output()
    options = dict(
        options,
        cuda_device=current_cuda_device(),
        stderr_fd=trainer_stderr,
        startup_niceness_increment=STARTUP_NICENESS_INCREMENT,
    )
    inherited = [options["control_fd"], options["descriptor_fd"]]
    if trainer_stderr is not None:
        inherited.append(trainer_stderr)
    command = [
        executable, *_interpreter_flags(), "-c", _BOOTSTRAP,
        json.dumps(_worker_sys_path()), json.dumps(options),
    ]
    try:
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stderr=startup_log,
            pass_fds=inherited,
            env={**os.environ, BACKGROUND_WORKER_ENV: "1"},  # skips strategy registration
        )
    except (OSError, subprocess.SubprocessError) as exc:
        if startup_log is not None:
            startup_log.close()
        raise WorkerDiedError(
            f"rank {rank}: cannot start the persistent checkpoint worker ({executable}): {exc}; "
            "use the temporal caller (AsyncCallsQueue(persistent=False)) if this interpreter "
            "cannot be started"
        ) from exc
    finally:
        if trainer_stderr is not None:
            os.close(trainer_stderr)
    return popen, startup_log


def _interpreter_flags() -> List[str]:
    """The trainer's interpreter flags (``-W``, ``-X``, ``-O``...), as spawn passes them.

    ``subprocess._args_from_interpreter_flags`` is what multiprocessing itself uses.
    """
    flags = getattr(subprocess, "_args_from_interpreter_flags", None)
    return list(flags()) if flags is not None else []


def _worker_sys_path() -> List[str]:
    """The trainer's ``sys.path``, as strings, with the current directory spelled out."""
    try:
        cwd = os.getcwd()
    except OSError:  # the current directory was removed: it cannot hold modules either
        cwd = None
    entries = [os.fsdecode(e) for e in sys.path if isinstance(e, (str, bytes, os.PathLike))]
    return [cwd if entry == "" else entry for entry in entries if entry != "" or cwd is not None]


def _capture_startup_output() -> Tuple[Optional[Any], Optional[int]]:
    """An unlinked file for the worker's start-up stderr, and a copy of our stderr for later.

    ``(None, None)`` when either is unavailable: the worker then inherits our stderr.
    """
    try:
        startup_log = tempfile.TemporaryFile(prefix="megatron-async-worker-")
    except OSError as exc:
        logger.debug("worker start-up output is not captured: %s", exc)
        return None, None
    try:
        return startup_log, os.dup(2)
    except OSError as exc:  # no stderr at all
        logger.debug("worker start-up output is not captured: %s", exc)
        startup_log.close()
        return None, None
