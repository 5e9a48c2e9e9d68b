"""Module-level functions for tests to run in background processes.

They must be importable by name (the persistent worker, a fresh interpreter, unpickles
them by module and name), so they live here rather than inside test functions or scripts.
"""

import ctypes
import os
import signal
import time

import torch


def write_text(path: str, staged, text: str) -> None:
    """Write ``text`` (plus the staged value, when there is one) to ``path``."""
    with open(path, "w") as f:
        f.write(text if staged is None else f"{text}:{staged}")


def sleep_then_write(path: str, staged, seconds: float) -> None:
    time.sleep(seconds)
    write_text(path, staged, "done")


def save_staged_tensor(path: str, staged, _unused=None) -> None:
    torch.save(staged, path)


def stage_clone(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone()


def stage_in_shared_memory(value):
    """A ``preload_fn``: copy a tensor, or each tensor of a dict, into shared memory of its
    own (page-locked for a CUDA tensor), as a forked or persistent worker reads it."""
    from megatron_async.core import shared_memory

    if isinstance(value, dict):
        return {key: stage_in_shared_memory(item) for key, item in value.items()}
    segment = shared_memory.allocate_segment(value.nbytes)
    if value.is_cuda:
        shared_memory.pin_segment(segment)
    host = shared_memory.segment_view(segment, 0, tuple(value.shape), value.dtype)
    host.copy_(value)
    return host


def stage_fails(message: str):
    raise ValueError(message)


def raise_error(path: str, staged, message: str) -> None:
    raise OSError(message)


def kill_self(path: str, staged, _unused=None) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def segfault(path: str, staged, _unused=None) -> None:
    ctypes.string_at(0)


def exit_early(path: str, staged, code: int) -> None:
    os._exit(code)


def record_pid_and_hang(pid_path: str, staged, seconds: float) -> None:
    with open(pid_path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_path + ".tmp", pid_path)
    time.sleep(seconds)


def _wait_for_file(release_path: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(release_path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{release_path} never appeared")
        time.sleep(0.01)


def write_after_release(path: str, staged, release_path: str) -> None:
    """Write ``path`` once ``release_path`` exists (bounded: 120 s)."""
    _wait_for_file(release_path)
    write_text(path, staged, "released")


def stage_without_copy(tensor: torch.Tensor) -> torch.Tensor:
    """Stage like megatron-core's preload does for CPU tensors: ``.to("cpu")``, no copy."""
    return tensor.to("cpu")


def save_staged_tensor_after_release(path: str, staged, release_path: str) -> None:
    """``torch.save`` the staged value once ``release_path`` exists (bounded: 120 s)."""
    _wait_for_file(release_path)
    torch.save(staged, path)


def write_worker_facts(path: str, staged, _unused=None) -> None:
    """Write what the background process is: its pid and where it imported us from."""
    import json
    import sys

    facts = {
        "pid": os.getpid(),
        "package_file": sys.modules["megatron_async"].__file__,
    }
    with open(path + ".tmp", "w") as f:
        json.dump(facts, f)
    os.replace(path + ".tmp", path)


def record_nice(path: str, staged, _unused=None) -> None:
    """Write the writer thread's nice value to ``path``."""
    with open(path, "w") as f:
        f.write(str(os.nice(0)))


class UnpicklableError(Exception):
    """An exception that pickles but cannot be unpickled (a required argument it drops)."""

    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")


def raise_unpicklable(path: str, staged, reason: str) -> None:
    raise UnpicklableError(path, reason)


def save_staged_tensor_and_pid(path: str, staged, _unused=None) -> None:
    """``torch.save`` the staged value together with the pid of the process writing it."""
    torch.save({"tensor": staged, "pid": os.getpid()}, path)
