"""Keep an overwritten checkpoint restorable until the save that replaces it is planned.

Runs on the coordinator (rank 0) of a save into a directory that holds a complete
checkpoint, with ``overwrite=True`` (the default). Such a save must first make the old
checkpoint read as incomplete, before anything of it changes: its completion markers go
first, and on megatron-core up to 0.18 that happens in the ``common.pt`` guard, right
before megatron-core writes a new ``common.pt``
(:mod:`megatron_async.mcore.common_guard`). Deleting the markers there lost the old
checkpoint to any input that planning then refuses (overlapping shards with
``validate_access_integrity=False``, a rank that cannot write the directory, ...),
although none of its data files had changed.

So the markers, and the old ``common.pt`` on those generations, are *set aside* instead:
renamed to hidden names in the same directory (``.metadata.replaced-<id>``). Loaders see
the checkpoint as incomplete exactly as before. Then:

* planning fails (on any rank, agreed on every rank before a data file is touched):
  :meth:`SetAside.restore` renames them back, the old ``common.pt`` over the new one,
  and the old checkpoint is complete again, unchanged;
* planning succeeds: the data files are about to be rewritten, so the old checkpoint
  cannot come back; the save's finalization (commit, failure or abandon) deletes the
  set-aside files (:meth:`SetAside.discard`).

Only local directories: an object store has no rename (its markers are deleted as
before). The guard sets aside for our strategy only; another strategy's save gets the
plain removal, since nothing would restore or discard for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_async.core.coordinator_step import DeadlineExpired, run_with_deadline
from megatron_async.storage.local import LocalStorage, fsync_path

__all__ = ["SetAside", "set_aside", "take_set_aside", "drop_registered"]

logger = logging.getLogger(__name__)

_DISCARD_TIMEOUT_S = 30.0
"""The most the coordinator waits for deleting set-aside files between two collectives."""

_lock = threading.Lock()
_pending: Dict[str, "SetAside"] = {}
"""Set-asides of the guard, by directory, until the strategy's planning takes them."""


@dataclasses.dataclass
class SetAside:
    """Files of a complete checkpoint renamed to hidden names in its directory (coordinator).

    Attributes:
        directory: the checkpoint directory.
        moved: (original path, hidden path) of every file set aside, in the order moved.
    """

    directory: str
    moved: List[Tuple[str, str]]

    def merge(self, other: Optional["SetAside"]) -> "SetAside":
        """This set-aside with ``other``'s files too (the same directory)."""
        if other is not None:
            self.moved.extend(other.moved)
        return self

    def restore(self) -> None:
        """Put every file back under its name, replacing what is there now (coordinator).

        Markers last (they are moved first), so a crash midway leaves the checkpoint
        incomplete, never complete with a new ``common.pt``. Logs, never raises: the
        planning error is what the caller raises.
        """
        try:
            for original, hidden in reversed(self.moved):
                os.replace(hidden, original)
            fsync_path(self.directory, best_effort=True)
            self.moved.clear()
            logger.warning(
                "the save into %s failed before writing any data; the checkpoint it would "
                "have overwritten is restored", self.directory,
            )
        except OSError as exc:
            logger.error(
                "could not restore the checkpoint in %s after its overwrite failed (%s); its "
                "set-aside files stay there as %s", self.directory, exc,
                ", ".join(hidden for _, hidden in self.moved),
            )

    def discard(self) -> None:
        """Delete the files set aside: the save went past planning (coordinator; best effort,
        bounded: on a mount that stopped answering the deletions are left behind)."""
        moved, self.moved = list(self.moved), []
        if moved:
            try:
                run_with_deadline(lambda: _delete(moved), _DISCARD_TIMEOUT_S, "discarding set-aside files")
            except DeadlineExpired:
                logger.warning("deleting %s did not finish in time; left behind", moved)


def _delete(moved: List[Tuple[str, str]]) -> None:
    storage = LocalStorage()
    for _, hidden in moved:
        try:
            storage.remove(hidden)  # a file already gone is fine
        except OSError as exc:
            logger.warning("could not delete %s: %s", hidden, exc)


def set_aside(
    directory: str, names: Sequence[str], register: bool = False, only_if: Sequence[str] = ()
) -> SetAside:
    """Rename the files ``names`` of ``directory`` that exist to hidden names (coordinator).

    Args:
        directory: a local checkpoint directory.
        names: file names, markers first.
        register: keep it for :func:`take_set_aside` (the guard, which runs before the
            strategy); any earlier registered set-aside of the directory is discarded.
        only_if: set nothing aside unless one of these files exists (the markers: a
            directory without them holds no checkpoint to keep).

    Returns:
        What was set aside (possibly nothing).

    Raises:
        OSError: a rename failed; what was already moved is put back first.
    """
    tag = uuid.uuid4().hex[:8]
    result = SetAside(directory, [])
    if only_if and not any(os.path.exists(os.path.join(directory, name)) for name in only_if):
        names = ()
    try:
        for name in names:
            original = os.path.join(directory, name)
            hidden = os.path.join(directory, f".{name.lstrip('.')}.replaced-{tag}")
            try:
                os.replace(original, hidden)
            except FileNotFoundError:
                continue
            result.moved.append((original, hidden))
        if result.moved:
            fsync_path(directory, best_effort=True)
    except OSError:
        for original, hidden in reversed(result.moved):
            os.replace(hidden, original)
        raise
    if register:
        with _lock:
            stale = _pending.pop(directory, None)
            _pending[directory] = result
        if stale is not None:  # a guarded save whose strategy never took it
            stale.discard()
    return result


def take_set_aside(directory: str) -> Optional[SetAside]:
    """The guard's set-aside of ``directory``, now owned by the caller (coordinator)."""
    with _lock:
        return _pending.pop(directory, None)


def drop_registered(directory: str, restore: bool) -> None:
    """End the guard's set-aside of ``directory`` that no strategy will take (coordinator):
    ``restore`` (megatron-core's ``common.pt`` write failed: no data file was touched, so
    the old checkpoint comes back whole) or discard (a save of another strategy replaces
    the checkpoint; a stale set-aside must not be restored over its files later)."""
    stale = take_set_aside(directory)
    if stale is not None and restore:
        stale.restore()
    elif stale is not None:
        stale.discard()
