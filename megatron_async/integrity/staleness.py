"""Stale-checkpoint detection: did anything change since the previous save of this job?

Runs on every rank, inside the finalization of a save, before ``.metadata`` is written.
Each rank compares the digests of the items it wrote (the background writer hashes what
it writes) with its own previous save's: one dictionary lookup per item, no I/O and
nothing gathered. The per-rank counts are summed in the finalization's one all-reduce
(:meth:`ChangeReport.counts`, :meth:`ChangeReport.from_counts`), so every rank knows
the job-wide comparison; the coordinator logs it. What counts as stale, and why it
matters, is in docs/failures.md ("Stale checkpoints").
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, List, Optional, Sequence, Tuple

__all__ = ["ChangeReport", "digests_of", "judge_staleness"]

logger = logging.getLogger(__name__)

ItemKey = Tuple[str, Optional[Tuple[int, ...]]]
"""An item of a checkpoint: its fully qualified name and its chunk offsets."""


def digests_of(results: Iterable[Any]) -> List[Tuple[ItemKey, str]]:
    """``(item key, digest)`` of the write results that hold data and carry a digest (any
    rank); chunks without elements, which several ranks may write, are left out."""
    digests = []
    for result in results:
        digest = getattr(result, "checksum", None)
        if digest is None or getattr(result, "empty_chunk", False):
            continue
        index = result.index
        digests.append(((index.fqn, None if index.offset is None else tuple(index.offset)), digest))
    return digests


@dataclasses.dataclass(frozen=True)
class ChangeReport:
    """How a save's items compare with the previous save's: one rank's items
    (:meth:`~megatron_async.saver.finalize.PreviousSave.compare`, every rank) or the whole job's
    (:meth:`from_counts`, the same on every rank).

    Attributes:
        items: items with a digest in this save.
        changed: items whose digest differs from the previous save's, or that it did not have.
        previous_checkpoint: the previous save's checkpoint; None for the first save.
    """

    items: int
    changed: int
    previous_checkpoint: Optional[str]

    def counts(self) -> List[int]:
        """``[has a previous save, items, changed]``, to be summed over ranks."""
        return [int(self.previous_checkpoint is not None), self.items, self.changed]

    @classmethod
    def from_counts(
        cls, summed: Sequence[int], world_size: int, previous_checkpoint: Optional[str]
    ) -> "ChangeReport":
        """The job-wide report from :meth:`counts` summed over ``world_size``
        ranks; a save that some rank made without a previous one counts as a first save."""
        with_previous, items, changed = summed
        return cls(items, changed, previous_checkpoint if with_previous == world_size else None)

    @property
    def is_stale(self) -> bool:
        """Nothing changed while the checkpoint moved on."""
        return self.previous_checkpoint is not None and self.items > 0 and self.changed == 0

    def summary(self) -> str:
        """One phrase for the per-save log line."""
        if self.previous_checkpoint is None:
            return f"{self.items} items hashed (first save of this job)"
        return f"{self.changed} of {self.items} items changed since the previous save"


def judge_staleness(checkpoint: str, report: ChangeReport) -> None:
    """Log a WARNING when a job-wide report says nothing changed (the coordinator).

    A save into the same checkpoint as the previous one (an overwrite) is compared
    but never called stale.

    Args:
        checkpoint: the checkpoint being committed.
        report: the comparison of the whole job's items.
    """
    if not report.is_stale or report.previous_checkpoint == checkpoint:
        return
    message = (
        f"checkpoint {checkpoint} holds exactly the data of the previous save "
        f"{report.previous_checkpoint}: none of its {report.items} items changed although "
        "training went on. The saved tensors may be stale copies (a cache that "
        "keeps serving an old buffer); compare the model's live parameters with "
        "the saved ones before relying on this checkpoint."
    )
    logger.warning(message)
