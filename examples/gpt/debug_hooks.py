"""Debugging hooks of the example's saves, set through environment variables.

Runs on every rank when a save is scheduled; the wrapped write runs in the background
process. The hooks apply to saves of both tiers (persistent and local). The functional
tests use them to kill a job in the middle of an async save, to make saves fail
(tests/functional/test_pretrain_gpt.py), to lose a job right after a save, and to kill a
node while a local save is being replicated
(tests/functional/test_pretrain_gpt_local_checkpoints.py). Debugging only: nothing sets
them outside tests.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import signal
import time
from typing import Dict, Optional, Tuple

import torch

__all__ = ["DEBUG_CRASH_AFTER_ENV", "DEBUG_HOLD_WRITE_ENV", "DEBUG_SAVE_DELAY_ENV",
           "DEBUG_SAVE_FAULT_ENV", "DebugSaveHooks", "crash_iteration"]

DEBUG_SAVE_DELAY_ENV = "PRETRAIN_GPT_DEBUG_SAVE_DELAY"
"""``"ITERATION:SECONDS"``: the background write of that iteration's checkpoint sleeps for
SECONDS after writing its shards, before the save can finalize."""

DEBUG_SAVE_FAULT_ENV = "PRETRAIN_GPT_DEBUG_SAVE_FAULT"
"""``"ITERATION:FAULT[,ITERATION:FAULT...]"``: the background write of that iteration's
checkpoint fails on the last rank (rank 1 of two), with FAULT ``disk_full`` (the write
raises ENOSPC) or ``dead_worker`` (the writing process is SIGKILLed)."""

DEBUG_CRASH_AFTER_ENV = "PRETRAIN_GPT_DEBUG_CRASH_AFTER"
"""``"ITERATION"``: once the saves of that iteration are durable, every rank exits at once
with status 1, without a final save, as if the job were lost right there."""

DEBUG_HOLD_WRITE_ENV = "PRETRAIN_GPT_DEBUG_HOLD_WRITE"
"""``"ITERATION:RANK:PATH"``: the background writer of RANK for that iteration's checkpoint
creates the file PATH (holding its pid), then holds for :data:`HOLD_WRITE_S` before it
writes anything. A test watches for PATH and kills the node meanwhile: the save is then
half done, the other ranks' writers writing or replicating their parts and RANK's part
written nowhere."""

HOLD_WRITE_S = 60.0
"""How long :data:`DEBUG_HOLD_WRITE_ENV` holds a write (then it writes as usual)."""

FAULTS = ("disk_full", "dead_worker")


def crash_iteration() -> Optional[int]:
    """The iteration after which :data:`DEBUG_CRASH_AFTER_ENV` asks the job to die, or None."""
    value = os.environ.get(DEBUG_CRASH_AFTER_ENV)
    return int(value) if value else None


def _write_then_stall(async_fn, delay_s: float, *args, **kwargs):
    """Background side of the delay: write as usual, then hold the save open."""
    result = async_fn(*args, **kwargs)
    time.sleep(delay_s)
    return result


def _announce_then_hold(async_fn, marker: str, *args, **kwargs):
    """Background side of the hold: say so in ``marker``, wait, then write as usual."""
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(HOLD_WRITE_S)
    return async_fn(*args, **kwargs)


def _fail_write(fault: str, *args, **kwargs) -> None:
    """Background side of a fault: the write of this rank fails instead of writing."""
    if fault == "dead_worker":
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(errno.ENOSPC, f"No space left on device (injected by {DEBUG_SAVE_FAULT_ENV})")


@dataclasses.dataclass(frozen=True)
class DebugSaveHooks:
    """The hooks the environment asks for."""

    delay: Optional[Tuple[int, float]] = None
    faults: Dict[int, str] = dataclasses.field(default_factory=dict)
    hold: Optional[Tuple[int, int, str]] = None
    """``(iteration, rank, marker path)`` of :data:`DEBUG_HOLD_WRITE_ENV`."""

    @classmethod
    def from_environment(cls) -> "DebugSaveHooks":
        delay = None
        if os.environ.get(DEBUG_SAVE_DELAY_ENV):
            iteration, _, seconds = os.environ[DEBUG_SAVE_DELAY_ENV].partition(":")
            delay = (int(iteration), float(seconds))
        faults = {}
        for item in filter(None, os.environ.get(DEBUG_SAVE_FAULT_ENV, "").split(",")):
            iteration, _, fault = item.partition(":")
            if fault not in FAULTS:
                raise ValueError(f"{DEBUG_SAVE_FAULT_ENV}: unknown fault {fault!r} in {item!r}; use one of {FAULTS}")
            faults[int(iteration)] = fault
        hold = None
        if os.environ.get(DEBUG_HOLD_WRITE_ENV):
            iteration, rank, marker = os.environ[DEBUG_HOLD_WRITE_ENV].split(":", 2)
            hold = (int(iteration), int(rank), marker)
        return cls(delay, faults, hold)

    def wrap(self, request, iteration: int):
        """The request to schedule for ``iteration``'s save (every rank); None (a
        synchronous save, already done) stays None."""
        if request is None:
            return None
        if self.delay is not None and self.delay[0] == iteration:
            request = request._replace(
                async_fn=functools.partial(_write_then_stall, request.async_fn, self.delay[1])
            )
        last_rank = torch.distributed.get_world_size() - 1
        if iteration in self.faults and torch.distributed.get_rank() == last_rank:
            request = request._replace(async_fn=functools.partial(_fail_write, self.faults[iteration]))
        if self.hold is not None and self.hold[:2] == (iteration, torch.distributed.get_rank()):
            request = request._replace(
                async_fn=functools.partial(_announce_then_hold, request.async_fn, self.hold[2])
            )
        return request
