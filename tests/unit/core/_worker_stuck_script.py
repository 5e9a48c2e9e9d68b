"""A persistent worker killed before it read a request must not pin that request's staging."""

import functools
import gc
import os
import signal
import sys
import time

import torch

from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.persistent import PersistentAsyncCaller
from megatron_async.core.request import AsyncRequest
from tests import background_fns as fns

MIB = 2**20


def _shm_used() -> int:
    stats = os.statvfs("/dev/shm")
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


def _save_to_a_stuck_worker(out_dir: str, call_idx: int) -> str:
    caller = PersistentAsyncCaller(AsyncCallerConfig(timeout_s=1.0, poll_interval_s=0.05))
    # Stopped once ready: it stops reading requests, not its start.
    deadline = time.monotonic() + 60
    while not caller.is_worker_ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(caller.process.pid, signal.SIGSTOP)  # a ready worker that stops reading
    state = {"w": torch.ones(32 * MIB // 4)}
    request = AsyncRequest(
        fns.save_staged_tensor, (os.path.join(out_dir, "never.pt"), None), [],
        preload_fn=functools.partial(fns.stage_in_shared_memory, state), call_idx=call_idx,
    )
    caller.schedule_async_call(request)
    deadline = time.monotonic() + 60
    while not caller.poll(call_idx).is_terminal and time.monotonic() < deadline:
        time.sleep(0.05)
    status = caller.poll(call_idx)
    caller.release(call_idx)
    caller.close(abort=True)
    return status.failure.phase if status.failure else status.state.value


def main(out_dir: str) -> None:
    before = _shm_used()
    phases = [_save_to_a_stuck_worker(out_dir, idx) for idx in range(3)]
    gc.collect()
    print("phases:", ",".join(phases))
    print("shm growth MiB:", round((_shm_used() - before) / MIB))


if __name__ == "__main__":
    main(sys.argv[1])
