"""Which checkpoint directories this process is still writing (every rank, its own record).

A save claims its directory when it is planned and releases it when its finalization
ends (or when its request is dropped unfinalized). The strategy refuses a second save
into a claimed directory, and so does the ``common.pt`` guard, which runs before any
sharded strategy. Every rank keeps its own record; the records agree because every
rank schedules the same saves.

The record is process-wide on purpose: any strategy instance, and megatron-core's
common-state step, must see every save of the process.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from typing import Any, Dict, List

__all__ = ["InFlightCheckpoints", "checkpoints_in_flight"]


class InFlightCheckpoints:
    """A thread-safe set of checkpoint directories, each claimed by one save (a token)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: Dict[str, int] = {}
        self._tokens = itertools.count()

    def claim(self, checkpoint_dir: str) -> int:
        """Mark ``checkpoint_dir`` as being written; return the claim's token."""
        key = _key(checkpoint_dir)
        with self._lock:
            token = next(self._tokens)
            self._claims[key] = token
            return token

    def release(self, checkpoint_dir: str, token: int) -> None:
        """End the claim ``token`` on ``checkpoint_dir`` (a newer claim stays)."""
        key = _key(checkpoint_dir)
        with self._lock:
            if self._claims.get(key) != token:  # a link that now points elsewhere
                key = next((k for k, t in self._claims.items() if t == token), None)
            if key is not None and self._claims.get(key) == token:
                del self._claims[key]

    def release_when_dropped(self, owner: Any, checkpoint_dir: str, token: int) -> None:
        """Release the claim when ``owner`` is garbage collected (a request never finalized)."""
        weakref.finalize(owner, self.release, checkpoint_dir, token)

    def __contains__(self, checkpoint_dir: str) -> bool:
        key = _key(checkpoint_dir)
        with self._lock:
            return key in self._claims

    def directories(self) -> List[str]:
        """The claimed directories, sorted."""
        with self._lock:
            return sorted(self._claims)


def _key(checkpoint_dir: str) -> str:
    """The directory a local path names, links resolved (two names of one directory are
    one claim); object-storage URLs as they are."""
    return checkpoint_dir if "://" in checkpoint_dir else os.path.realpath(checkpoint_dir)


checkpoints_in_flight = InFlightCheckpoints()
"""The record of this process."""
