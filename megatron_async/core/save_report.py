"""One INFO line per finalized save: where its time went on this rank (every rank).

The queue writes the line once a call's finalize functions ran (so exactly once per
finalized save, on every rank). A finalize function that knows its save (our strategy's
commit step) adds the details through a ``save_details()`` method: the checkpoint, the
planning time, the background write time and the bytes this rank wrote. Requests built
elsewhere get the line with what the queue itself measured.

The per-phase detail (planning, staging copy, scheduling, the write, the gather, the
metadata write) is logged at DEBUG level by the modules that run each phase.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

__all__ = ["SaveDetails", "checkpoint_of", "details_of", "log_finalized_save"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SaveDetails:
    """What the commit step of a save knows about it (trainer side, one rank).

    Attributes:
        checkpoint: the checkpoint directory.
        plan_s: time the trainer spent planning (the first part of the stall).
        write_s: time the background write took, as the writer measured it.
        num_bytes: bytes this rank wrote.
        changes: on the coordinator, how many items changed since the previous save.
        staging_bytes: the most staging memory the save held (its pool when staged in
            rounds, else its state).
        staging_rounds: how many rounds the state was staged in (1: in one go).
    """

    checkpoint: str
    plan_s: float
    write_s: Optional[float]
    num_bytes: Optional[int]
    changes: Optional[str] = None
    staging_bytes: Optional[int] = None
    staging_rounds: Optional[int] = None


def details_of(request: Any) -> Optional[SaveDetails]:
    """The details the request's finalize functions provide, if one does."""
    for fn in getattr(request, "finalize_fns", None) or ():
        provide = getattr(fn, "save_details", None)
        if callable(provide):
            return provide()
    return None


def checkpoint_of(request: Any) -> Optional[str]:
    """The checkpoint a request saves, when its finalize functions say (for the headline
    of its failure); None when they do not, or cannot after the failure."""
    try:
        details = details_of(request)
    except Exception:  # the failed save left its details incomplete: no name, no harm
        logger.debug("cannot name the checkpoint of a failed save", exc_info=True)
        return None
    return details.checkpoint if details is not None else None


def log_finalized_save(
    rank: int,
    call_idx: int,
    schedule_s: float,
    finalize_s: float,
    details: Optional[SaveDetails],
) -> None:
    """Log the INFO line of one finalized save (every rank, after its finalize functions).

    Args:
        rank: this rank.
        call_idx: the call's index in the queue.
        schedule_s: time ``schedule_async_request`` took (staging, the rest of the stall).
        finalize_s: time the finalize functions took.
        details: the save's details, when its finalize functions provide them.
    """
    if not logger.isEnabledFor(logging.INFO):
        return
    if details is None:
        logger.info(
            "rank %d: async call %d finalized: stall %.3fs (scheduling), finalize %.3fs",
            rank, call_idx, schedule_s, finalize_s,
        )
        return
    stall_s = details.plan_s + schedule_s
    if details.write_s and details.num_bytes is not None:
        rate = f"{details.num_bytes / details.write_s / 1e9:.2f} GB/s"
    else:
        rate = "rate unknown"
    write = f"{details.write_s:.3f}s" if details.write_s is not None else "unknown"
    written = f"{details.num_bytes} bytes" if details.num_bytes is not None else "unknown bytes"
    staging = ""
    if details.staging_bytes is not None:
        staging = f", staging peak {details.staging_bytes} bytes in {details.staging_rounds} round(s)"
    logger.info(
        "rank %d: checkpoint %s saved (async call %d): stall %.3fs (plan %.3fs + staging "
        "%.3fs), background write %s, %s, %s%s, finalize %.3fs%s",
        rank, details.checkpoint, call_idx, stall_s, details.plan_s, schedule_s, write,
        written, rate, staging, finalize_s, f"; {details.changes}" if details.changes else "",
    )
