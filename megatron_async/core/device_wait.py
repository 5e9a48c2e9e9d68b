"""A bounded wait for the device-to-host copies a thread queued on CUDA devices.

Runs on the thread that queued the copies: the training thread (staging, snapshots, the
temporal caller before it forks) or a staging copy thread (staging in rounds, overlapped
staging). ``torch.cuda.synchronize(device)`` would also wait for the collectives in
flight on the device's other streams, with no bound (one whose peer died never ends).
:func:`wait_for_device_copies` instead records an event on each device's *current*
stream, where the copies were queued (:func:`wait_for_stream`: on a given stream), and
polls it against a deadline. The copies still run after whatever that stream holds
before them (the training step's kernels), as they must.

Host memory that a copy may still write into must not be freed. What the caller passes as
``holding`` is kept alive until the copies land (:func:`release_landed`, run at every
wait) wherever the wait ends before they did: a timeout, a device error, an interrupt
(raised at once then). Without ``holding``, an interrupt is raised only once the copies
landed or the bound passed.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, List, Optional, Tuple

import torch

from megatron_async.core.config import STAGING_WAIT_S
from megatron_async.errors import AsyncTimeoutError

__all__ = [
    "DeviceCopyTimeoutError", "landed_after_failure",
    "release_landed", "wait_for_device_copies", "wait_for_stream",
]


# Internal pacing of the poll, not bounds: how soon a landed copy is seen.
_SPIN_S = 100e-6  # short copies: query without sleeping first (a sleep lasts >= ~60 us)
_FIRST_PAUSE_S = 20e-6
_LONGEST_PAUSE_S = 200e-6  # a copy is seen done within 0.2 ms; a poll costs about 1 us

# A per-process fact with no owner: host memory a CUDA stream of this process may still
# write into, whichever save's wait gave up on it; any later wait, of any save, frees it.
_held_lock = threading.Lock()
_held: List[Tuple[List[Any], Any]] = []  # (events, what their copies write into)


class DeviceCopyTimeoutError(AsyncTimeoutError):
    """A device did not run the copies queued on it in time; they may still land, so the
    host memory they write into is kept until they do."""


def wait_for_device_copies(
    devices: Iterable[torch.device],
    timeout_s: float = STAGING_WAIT_S,
    holding: Any = None,
) -> None:
    """Return once everything this thread queued so far on each CUDA device's current
    stream has run (the thread that queued the copies).

    ``holding``: the host memory the copies write into (any object that keeps it alive),
    kept until they land if this raises.

    Raises:
        DeviceCopyTimeoutError: a device did not get there within ``timeout_s``.
    """
    devices = list(devices)
    if devices:
        _wait([(str(d), torch.cuda.current_stream(d)) for d in devices], timeout_s, holding)


def wait_for_stream(
    stream: Any, timeout_s: float = STAGING_WAIT_S, holding: Any = None
) -> None:
    """:func:`wait_for_device_copies` for the copies queued on ``stream`` (a side stream)."""
    _wait([(str(stream.device), stream)], timeout_s, holding)


def landed_after_failure(devices: Iterable[torch.device] = (), holding: Any = None, stream: Any = None) -> bool:
    """After a failure, whether the copies queued so far (on ``devices``' current streams,
    or on ``stream``) landed within a second; if not, ``holding`` is kept until they do
    (the thread that queued them). Never raises: the failure at hand is the one raised."""
    try:
        if stream is not None:
            wait_for_stream(stream, timeout_s=1.0, holding=holding)
        else:
            wait_for_device_copies(devices, timeout_s=1.0, holding=holding)
    except BaseException:
        return False
    return True


def _wait(streams: List[Tuple[str, Any]], timeout_s: float, holding: Any) -> None:
    release_landed()
    events = []
    for _, stream in streams:
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    deadline = time.monotonic() + timeout_s
    interrupt: Optional[BaseException] = None
    for (device, _), event in zip(streams, events):
        spin_until, pause = time.monotonic() + _SPIN_S, _FIRST_PAUSE_S
        while True:
            try:
                if event.query():
                    break
                now = time.monotonic()
                if now >= deadline:
                    _hold(events, holding)
                    raise DeviceCopyTimeoutError(
                        f"the copies from {device} to host memory did not finish within "
                        f"{timeout_s:.0f}s: the device makes no progress (a collective waiting "
                        "for a rank that died?). This save fails; the previous checkpoint is kept"
                    ) from interrupt
                if now >= spin_until:
                    time.sleep(min(pause, deadline - now))
                    pause = min(2 * pause, _LONGEST_PAUSE_S)
            except (KeyboardInterrupt, SystemExit) as exc:
                if holding is not None:  # the memory is kept until the copies land: go now
                    _hold(events, holding)
                    raise
                interrupt = interrupt or exc  # the caller frees the memory: wait on
            except DeviceCopyTimeoutError:
                raise
            except BaseException:  # a device error: the copies may never be seen to land
                _hold(events, holding)
                raise
    if interrupt is not None:
        raise interrupt


def _hold(events: List[Any], holding: Any) -> None:
    if holding is not None:
        with _held_lock:
            _held.append((events, holding))


def _landed(events: List[Any]) -> bool:
    try:
        return all(event.query() for event in events)
    except Exception:  # a device error: never known to have landed
        return False


def release_landed() -> None:
    """Let go of the host memory kept for copies that have landed since (any thread)."""
    kept: List[Tuple[List[Any], Any]] = []
    landed: List[Tuple[List[Any], Any]] = []
    with _held_lock:
        for entry in _held:
            (landed if _landed(entry[0]) else kept).append(entry)
        _held[:] = kept
    del landed  # their memory is freed here, outside the lock
