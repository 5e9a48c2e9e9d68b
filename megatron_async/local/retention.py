"""Which iterations a rank's holder directory keeps, and the finalize step of a local save.

Runs on every rank, in the trainer. :class:`LocalRetention` is the bookkeeping of one
:class:`~megatron_async.local.manager.LocalCheckpointManager`: the newest iteration kept
(finalized or recovered), which is never removed by a save, and the iterations of saves
still in flight. A save first removes what failed saves left
(:meth:`LocalRetention.remove_failed_saves`); its :class:`FinalizeLocalSave` step, which
the queue runs once every rank's writer succeeded, makes it the kept iteration (the next
save's writer removes the older ones), or, when the save failed, removes that save's own
files.
"""

from __future__ import annotations

import logging
import os
from typing import Set

from megatron_async.core.request import SaveDetails
from megatron_async.errors import LocalSaveFailedError
from megatron_async.local import parts
from megatron_async.staging.torch_save import TorchSaveStaged

__all__ = ["LocalRetention", "FinalizeLocalSave"]

logger = logging.getLogger(__name__)


class LocalRetention:
    """The iterations one rank's holder directory keeps (every rank, trainer).

    Args:
        directory: the rank's holder directory.
        rank: the rank, for log lines.
    """

    def __init__(self, directory: str, rank: int):
        self.directory = directory
        self.rank = rank
        self.kept = -1
        """The newest iteration finalized or recovered here: never removed by a save."""
        self.in_flight: Set[int] = set()
        """Iterations saved, not yet finalized nor failed."""

    def floor(self) -> int:
        """The iteration the next save must be above: the newest kept or in flight."""
        return max([self.kept, *self.in_flight])

    def started(self, iteration: int) -> None:
        """A save of ``iteration`` was staged: its files stay until it ends."""
        self.in_flight.add(iteration)

    def recovered(self, iteration: int) -> None:
        """``iteration`` was recovered: no later save removes it before finalizing its own."""
        self.kept = iteration

    def remove_failed_saves(self, iteration: int) -> None:
        """Remove what failed saves left before the save of ``iteration`` starts:
        iterations above the one kept (all at or above ``iteration`` when none is known
        yet), except those of saves still in flight."""
        kept, in_flight = self.kept, set(self.in_flight)
        floor = kept if kept >= 0 else iteration - 1
        removed = parts.remove_iterations(
            self.directory, lambda i: i > floor and i not in in_flight
        )
        if removed:
            logger.info(
                "rank %d: removed %d file(s) of failed local saves from %s",
                self.rank, len(removed), self.directory,
            )

    def finalized(self, iteration: int) -> None:
        """Every part and replica of ``iteration`` is durable: the older iterations may
        go. The next save's writer removes them (:attr:`LocalSaveJob.remove_below`), off
        the training thread: unlinking a part of a few hundred MiB took tens of ms here.
        Until then the directory holds one more iteration; while that save is written it
        holds as many as before (the kept one and the one in flight)."""
        self.kept = max(self.kept, iteration)
        self.in_flight.discard(iteration)
        logger.debug("rank %d: local checkpoint %d finalized", self.rank, iteration)

    def failed(self, iteration: int) -> None:
        """The save of ``iteration`` failed: its files go (best effort; what stays goes at
        the start of the next save), so that a restart recovers the previous iteration."""
        self.in_flight.discard(iteration)
        removed = parts.remove_iterations(self.directory, lambda i: i == iteration)
        logger.info(
            "rank %d: local checkpoint %d failed; %d of its file(s) removed",
            self.rank, iteration, len(removed),
        )


class FinalizeLocalSave:
    """The finalize step of one local save (every rank, trainer).

    The queue runs it only once every rank's writer succeeded, i.e. every part and every
    replica of ``iteration`` is durable on its holder: older iterations can go. (Finalized
    with ``maybe_finalize_async_calls(no_dist=True)``, it runs once this rank's writer
    succeeded: the caller then vouches for the others.) When the save failed, the queue
    raises ``failure_error_type`` instead and calls :meth:`abandon`.

    Args:
        retention: the manager's bookkeeping of its holder directory.
        iteration: the saved iteration.
        staged: the save's staged state, given back if the save is abandoned.
        stats: the staging's ``peak_bytes`` and ``rounds``, for :meth:`save_details`.
    """

    failure_error_type = LocalSaveFailedError

    def __init__(
        self, retention: LocalRetention, iteration: int, staged: TorchSaveStaged, stats: dict
    ):
        self._retention = retention
        self._iteration = iteration
        self._staged = staged
        self._stats = stats

    def __call__(self) -> None:
        self._retention.finalized(self._iteration)

    def abandon(self) -> None:
        """The save failed or was never scheduled: give its staging memory back and remove
        this rank's files of its iteration."""
        try:
            self._staged.release()
        finally:
            self._retention.failed(self._iteration)

    def save_details(self) -> SaveDetails:
        """This rank's part and the save's staging, for the queue's INFO line."""
        retention = self._retention
        path = os.path.join(retention.directory, parts.part_name(self._iteration, retention.rank))
        try:
            size = os.stat(path).st_size
        except OSError:  # a failed save is only named (the error's headline); no part then
            size = 0
        stats = self._stats
        return SaveDetails(path, size, stats.get("peak_bytes", 0), stats.get("rounds", 0))
