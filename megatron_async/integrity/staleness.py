"""Stale-checkpoint detection: did anything change since the previous save of this job?

Runs on the coordinator rank, inside the commit of a save, before ``.metadata`` is
written. Every item's digest is already known there (the background writers hash what
they write), so comparing them with the previous save's costs one dictionary lookup per
item and no I/O. A save whose every item has the same digest as in the previous save of
the same job, into another checkpoint, means the job wrote the same weights again: the
symptom of a cache that serves stale tensors (an async path that kept the first save's
buffers), which nobody notices until a resume goes wrong. That case is logged as a
WARNING naming both checkpoints, or fails the save with ``fail_on_stale``. A save in
which only some items changed (frozen parameters while fine-tuning) is normal and only
counted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Dict, Hashable, Iterable, Optional, Tuple

from megatron_async.errors import CheckpointValidationError

__all__ = ["ChangeReport", "SaveDigestHistory", "StaleCheckpointError"]

logger = logging.getLogger(__name__)

ItemKey = Tuple[str, Optional[Tuple[int, ...]]]
"""An item of a checkpoint: its fully qualified name and its chunk offsets."""


class StaleCheckpointError(CheckpointValidationError):
    """Every item of a save equals the previous save's (with ``fail_on_stale``)."""


@dataclasses.dataclass(frozen=True)
class ChangeReport:
    """How a save's items compare with the previous save's (coordinator).

    Attributes:
        items: items with a digest in this save.
        changed: items whose digest differs from the previous save's.
        added: items the previous save did not have.
        previous_checkpoint: the previous save's checkpoint; None for the first save.
    """

    items: int
    changed: int
    added: int
    previous_checkpoint: Optional[str]

    @property
    def is_stale(self) -> bool:
        """Nothing changed while the checkpoint moved on."""
        return self.previous_checkpoint is not None and self.items > 0 and self.changed + self.added == 0

    def summary(self) -> str:
        """One phrase for the per-save log line."""
        if self.previous_checkpoint is None:
            return f"{self.items} items hashed (first save of this job)"
        return f"{self.changed + self.added} of {self.items} items changed since the previous save"


class SaveDigestHistory:
    """The digests of the previous save of one job, compared with each new save's.

    Owned by the save strategy (one per strategy, not copied with it); used on the
    coordinator rank only.

    Args:
        fail_on_stale: raise :class:`StaleCheckpointError` instead of warning.
    """

    def __init__(self, fail_on_stale: bool = False):
        self.fail_on_stale = fail_on_stale
        self._lock = threading.Lock()
        self._checkpoint: Optional[str] = None
        self._digests: Dict[Hashable, str] = {}

    def record(self, checkpoint: str, digests: Iterable[Tuple[Hashable, str]]) -> ChangeReport:
        """Compare a save's digests with the previous save's, then remember them.

        A save into the same checkpoint as the previous one (an overwrite) is compared
        but never called stale.

        Args:
            checkpoint: the checkpoint being committed.
            digests: ``(item key, digest)`` of every item with data.

        Returns:
            The comparison.

        Raises:
            StaleCheckpointError: with ``fail_on_stale``, when nothing changed; the
                history then still holds the previous save, and the save fails before
                its ``.metadata`` is written.
        """
        current = dict(digests)
        with self._lock:
            previous, previous_checkpoint = self._digests, self._checkpoint
            changed = added = 0
            for key, digest in current.items():
                before = previous.get(key)
                if before is None:
                    added += 1
                elif before != digest:
                    changed += 1
            report = ChangeReport(len(current), changed, added, previous_checkpoint)
            if report.is_stale and previous_checkpoint != checkpoint:
                message = (
                    f"checkpoint {checkpoint} holds exactly the data of the previous save "
                    f"{previous_checkpoint}: none of its {report.items} items changed although "
                    "training went on. The saved tensors may be stale copies (a cache that "
                    "keeps serving an old buffer); compare the model's live parameters with "
                    "the saved ones before relying on this checkpoint."
                )
                if self.fail_on_stale:
                    raise StaleCheckpointError(message)
                logger.warning(message)
            self._checkpoint, self._digests = checkpoint, current
        return report
