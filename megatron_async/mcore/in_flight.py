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
    """A thread-safe set of checkpoint directories, each claimed by one save (a token).

    A claim is keyed by the directory with its links resolved, so two names of one
    directory are one claim; it is released by its token alone, with no file-system call
    (a release runs on failure paths, where the file system may be the thing that hangs).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: Dict[str, int] = {}  # resolved directory -> token
        self._names: Dict[int, str] = {}  # token -> the directory as the save named it
        self._tokens = itertools.count()

    def claim(self, checkpoint_dir: str) -> int:
        """Mark ``checkpoint_dir`` as being written; return the claim's token."""
        key = _key(checkpoint_dir)
        with self._lock:
            token = next(self._tokens)
            replaced = self._claims.get(key)
            self._names.pop(replaced, None)
            self._claims[key], self._names[token] = token, checkpoint_dir
            return token

    def release(self, checkpoint_dir: str, token: int) -> None:
        """End the claim ``token`` on ``checkpoint_dir`` (a newer claim stays)."""
        with self._lock:
            if self._names.pop(token, None) is None:
                return
            key = next((k for k, t in self._claims.items() if t == token), None)
            if key is not None:
                del self._claims[key]

    def release_when_dropped(self, owner: Any, checkpoint_dir: str, token: int) -> None:
        """Release the claim when ``owner`` is garbage collected (a request never finalized)."""
        weakref.finalize(owner, self.release, checkpoint_dir, token)

    def __contains__(self, checkpoint_dir: str) -> bool:
        key = _key(checkpoint_dir)
        with self._lock:
            return key in self._claims

    def directories(self) -> List[str]:
        """The claimed directories as their saves named them, sorted."""
        with self._lock:
            return sorted(self._names.values())


def _key(checkpoint_dir: str) -> str:
    """The directory a local path names, links resolved (two names of one directory are
    one claim); object-storage URLs as they are."""
    return checkpoint_dir if "://" in checkpoint_dir else os.path.realpath(checkpoint_dir)


checkpoints_in_flight = InFlightCheckpoints()
"""The record of this process."""
