"""The interface every save method of the benchmarks implements (runs on every rank).

A training loop drives a :class:`SaveMethod` the same way in every benchmark: optionally
:meth:`~SaveMethod.start_early` before the model is built, :meth:`~SaveMethod.setup`, then
per checkpoint :meth:`~SaveMethod.save` (what blocks training: the *stall*), training
steps while the write goes on (:meth:`~SaveMethod.poll` between them), and
:meth:`~SaveMethod.wait` when the loop needs the checkpoint complete; finally
:meth:`~SaveMethod.close`. The stall and throughput benchmark waits right after one
training step; the lost-time benchmark polls every iteration.

Every moment is taken with ``time.monotonic`` (one clock for every process of the
machine, so a background process's stamps compare with the trainer's).
"""

from __future__ import annotations

import abc
import time
from typing import Any, Dict, List, Protocol

import torch

__all__ = ["Unsupported", "StateSource", "SaveMethod", "now"]


class Unsupported(RuntimeError):
    """This save method cannot run here; the message says why."""


def now() -> float:
    """The benchmarks' clock (``time.monotonic``)."""
    return time.monotonic()


class StateSource(Protocol):
    """What a save method saves: the training state of this rank, rebuilt per save."""

    def sharded_state_dict(self, iteration: int) -> Dict[str, Any]:
        """This rank's megatron-core sharded state dict."""

    def dcp_state_dict(self) -> Dict[str, torch.Tensor]:
        """The same tensors as a flat dict with keys unique to this rank (for DCP)."""


class SaveMethod(abc.ABC):
    """One way to checkpoint, on one rank (every rank builds its own and calls it in step).

    Attributes:
        name: the method's name in the results.
        notes: what a reader of the results should know about this method here
            (options that do not apply on this host, for example).
        timings: the moments of the last save, filled by :meth:`save` and :meth:`wait`:
            ``build_s`` (building the state dict), ``t_start`` and ``t_stall_end`` (the
            stall, building excluded), ``t_end`` (complete on this rank), ``write_start``
            and ``write_end`` (the background write), ``finalize_s``, and where the method
            has them ``plan_s``, ``stage_s``, ``strategy_plan_s`` and ``reused_plans``.
    """

    def __init__(self, name: str):
        self.name = name
        self.notes: List[str] = []
        self.timings: Dict[str, Any] = {}

    def start_early(self) -> None:
        """Create what a training script creates before its model (its save queue)."""

    def setup(self) -> None:
        """Create what lives across saves (queues, workers, stagers); may raise Unsupported."""

    @abc.abstractmethod
    def save(self, directory: str, index: int) -> None:
        """Start save number ``index`` into ``directory``; return when training may go on."""

    @abc.abstractmethod
    def poll(self) -> bool:
        """Non-blocking, collective: whether the last save is complete on every rank."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the last save is complete (bounded by the launch's timeout)."""

    def close(self) -> None:
        """Release what :meth:`start_early` and :meth:`setup` created."""

    def _begin(self) -> float:
        """Start the timings of a new save; return its first moment."""
        self.timings = {"plan_s": None, "stage_s": None, "strategy_plan_s": None,
                        "finalize_s": 0.0, "reused_plans": False}
        return now()
