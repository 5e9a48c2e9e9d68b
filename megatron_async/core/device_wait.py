"""A bounded wait for the device-to-host copies this thread queued on CUDA devices.

Runs on the thread that queued the copies: the training thread (staging, snapshots, the
temporal caller before it forks) or a staging copy thread (staging in rounds). ``torch.cuda.synchronize(device)`` is the usual
wait, and it has two faults on a training node:

* it waits for *every* stream of the device, so a save also waits for collectives still
  in flight on the communication streams (an overlapped gradient reduction, a parameter
  all-gather), which the copies do not depend on;
* it has no bound: if a peer of such a collective died, the device never finishes it and
  the trainer blocks in a C call that nothing interrupts.

:func:`wait_for_device_copies` records an event on each device's *current* stream, where
the copies were queued, and polls it against a deadline. The copies still run after
whatever that stream holds before them (the training step's kernels), as they must.
"""

from __future__ import annotations

import time
from typing import Iterable, List, Tuple

import torch

from megatron_async.errors import AsyncTimeoutError

__all__ = ["DEVICE_COPY_WAIT_S", "DeviceCopyTimeoutError", "wait_for_device_copies"]

DEVICE_COPY_WAIT_S = 600.0
"""How long the copies queued on one device may take, with the work queued before them
on the same stream. A device still busy after this makes no progress."""

class DeviceCopyTimeoutError(AsyncTimeoutError):
    """A device did not run the copies queued on it in time; they may still land, so their
    host buffers are never used again nor freed."""


_FIRST_PAUSE_S = 20e-6
_LONGEST_PAUSE_S = 200e-6  # a copy is seen done within 0.2 ms; a poll costs about 1 us


def wait_for_device_copies(devices: Iterable[torch.device], timeout_s: float = DEVICE_COPY_WAIT_S) -> None:
    """Return once everything this thread queued so far on each CUDA device's current
    stream has run (the thread that queued the copies).

    Raises:
        DeviceCopyTimeoutError: a device did not get there within ``timeout_s``. Its
            copies may still land later: the caller must not reuse or free the buffers
            they write into.
    """
    events: List[Tuple[torch.device, "torch.cuda.Event"]] = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append((device, event))
    deadline = time.monotonic() + timeout_s
    for device, event in events:
        pause = _FIRST_PAUSE_S
        while not event.query():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeviceCopyTimeoutError(
                    f"the copies from {device} to host memory did not finish within "
                    f"{timeout_s:.0f}s: the device makes no progress (a collective waiting "
                    "for a rank that died?). This save fails; the previous checkpoint is kept"
                )
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, _LONGEST_PAUSE_S)
