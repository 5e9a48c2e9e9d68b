"""The measurements ``tools/benchmark.py`` adds to its tables or runs alone (launching side).

* the training time lost per checkpoint (``--lost-time``, :mod:`.lost_time_run`);
* recovery after a lost node from local replicas, and the local save's host memory
  (``--local-recovery``, :mod:`.local_recovery_run`).

Each has a mode: ``off``, ``on`` (beside the main tables) or ``only`` (any ``only`` runs
the requested extras and nothing else).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List

from .local_recovery_run import (
    LocalRecoveryOptions,
    add_local_recovery_arguments,
    local_recovery_options,
    measure_local_recovery,
    render_local_recovery,
)
from .lost_time_run import (
    LostTimeOptions,
    add_lost_time_arguments,
    lost_time_options,
    measure_lost_time,
    render_lost_time,
)

__all__ = ["ExtraMeasurements", "add_extra_arguments", "render_extras"]


def add_extra_arguments(parser) -> None:
    """The ``--lost-time*`` and ``--local-recovery*`` options."""
    add_lost_time_arguments(parser)
    add_local_recovery_arguments(parser)


@dataclasses.dataclass(frozen=True)
class ExtraMeasurements:
    """Which extra measurements a benchmark run makes, with their options."""

    lost_time: LostTimeOptions = LostTimeOptions()
    local_recovery: LocalRecoveryOptions = LocalRecoveryOptions()

    @classmethod
    def from_args(cls, args) -> "ExtraMeasurements":
        """Read the parsed options; raise ValueError on bad ones."""
        return cls(lost_time_options(args), local_recovery_options(args))

    @property
    def only(self) -> bool:
        """Whether the run measures these and nothing else."""
        return "only" in (self.lost_time.mode, self.local_recovery.mode)

    def measure(self, config, log_path: Callable[[str], str]) -> Dict[str, Any]:
        """Run the launches asked for (``config``: the run's ``BenchConfig``); return the
        results' ``lost_time`` and ``local_recovery`` entries, where measured."""
        results: Dict[str, Any] = {}
        if self.lost_time.mode != "off":
            results["lost_time"] = measure_lost_time(
                self.lost_time, config.checkpoint_root, config.launch_timeout_s,
                config.threads_per_rank, log_path)
        if self.local_recovery.mode != "off":
            results["local_recovery"] = measure_local_recovery(self.local_recovery, config,
                                                               log_path)
        return results


def render_extras(results: Dict[str, Any], out_dir: str) -> List[str]:
    """The report.md lines of the extra measurements found in ``results`` (also for a
    ``--from-results`` redo, whatever the options)."""
    lines: List[str] = []
    if "lost_time" in results:
        lines += render_lost_time(results["lost_time"], out_dir)
    if "local_recovery" in results:
        lines += render_local_recovery(results["local_recovery"])
    return lines
