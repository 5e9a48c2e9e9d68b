"""What a training job does when a checkpoint save fails: stop, or go on and save again.

Runs on every rank, in the training loop. A failed save (an
:class:`~megatron_async.errors.AsyncSaveFailedError` from finalization, or a
:class:`~megatron_async.errors.CheckpointValidationError` /
:class:`~megatron_async.errors.CheckpointInProgressError` from planning) is raised
identically on every rank, so every rank takes the same decision here without a
collective.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from megatron_async.core import coordination
from megatron_async.errors import (
    AsyncSaveFailedError,
    CheckpointInProgressError,
    CheckpointValidationError,
    RankFailure,
)

__all__ = ["SAVE_FAILURE_POLICIES", "SaveFailurePolicy", "TooManySaveFailuresError", "SaveFailureTracker"]

logger = logging.getLogger(__name__)

SAVE_FAILURE_POLICIES = ("raise", "continue")
"""``raise``: a failed save ends the job (the default). ``continue``: log it and save again
at the next interval."""

_SAVE_FAILURES = (AsyncSaveFailedError, CheckpointValidationError, CheckpointInProgressError)


class TooManySaveFailuresError(AsyncSaveFailedError):
    """``max_consecutive_failures`` saves failed in a row under the ``continue`` policy.

    Carries the last failure's per-rank records (``rank_failures``), like any
    :class:`~megatron_async.errors.AsyncSaveFailedError`.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveFailurePolicy:
    """How a job reacts to a failed checkpoint save."""

    mode: str = "raise"
    """``"raise"`` (the failure ends the job) or ``"continue"`` (log it, save again at the
    next interval)."""

    max_consecutive_failures: int = 3
    """Under ``"continue"``: this many failed saves in a row end the job with
    :class:`TooManySaveFailuresError`; one successful save resets the count."""

    def __post_init__(self) -> None:
        if self.mode not in SAVE_FAILURE_POLICIES:
            raise CheckpointValidationError(
                f"save failure policy must be one of {SAVE_FAILURE_POLICIES}, got {self.mode!r}"
            )
        if not isinstance(self.max_consecutive_failures, int) or self.max_consecutive_failures < 1:
            raise CheckpointValidationError(
                "max_consecutive_failures must be an integer >= 1 (1 stops at the first "
                f"failure, like mode='raise'); got {self.max_consecutive_failures!r}"
            )


class SaveFailureTracker:
    """Apply a :class:`SaveFailurePolicy` to the saves of one job (every rank).

    Args:
        policy: the policy; the default raises every failure.
    """

    def __init__(self, policy: Optional[SaveFailurePolicy] = None):
        self.policy = policy or SaveFailurePolicy()
        self.consecutive_failures = 0

    def succeeded(self) -> None:
        """A save became durable: the run of failures is over."""
        self.consecutive_failures = 0

    def failed(self, error: BaseException, what: str) -> None:
        """Decide about a failed save: return to go on, or raise to stop the job.

        Args:
            error: what the save raised (the same on every rank).
            what: the save, for the log (e.g. ``"iteration 100 (/ckpt/iter_0000100)"``).

        Raises:
            the ``error`` itself: under ``"raise"``, and for errors that are no save
                failure (a lost peer, a bug).
            TooManySaveFailuresError: under ``"continue"``, once
                ``max_consecutive_failures`` saves failed in a row.
        """
        if self.policy.mode == "raise" or not isinstance(error, _SAVE_FAILURES):
            raise error
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.policy.max_consecutive_failures:
            raise self._too_many(error) from error
        logger.error(
            "checkpoint save of %s failed (%d in a row, %d allowed); training goes on and the "
            "next interval saves again. The tracker still names the last complete checkpoint. "
            "Cause:\n%s",
            what, self.consecutive_failures, self.policy.max_consecutive_failures, error,
        )

    def _too_many(self, error: BaseException) -> TooManySaveFailuresError:
        if isinstance(error, AsyncSaveFailedError):
            failures, checkpoint = error.rank_failures, error.checkpoint
        else:  # a planning failure: raised alike on every rank, recorded as this rank's
            rank = coordination.get_rank()
            failures, checkpoint = {rank: RankFailure.from_exception(rank, "plan", error)}, None
        return TooManySaveFailuresError(
            failures, checkpoint,
            hint=f"{self.consecutive_failures} checkpoint saves failed in a row, the most the "
            "save failure policy allows; the job stops. Fix the cause above and resume from "
            "the last complete checkpoint.",
        )
