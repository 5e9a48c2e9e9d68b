"""Recover a local checkpoint: one agreed decision, verified bytes, bulk moves (every rank).

:func:`recover_newest` runs on every rank at the same point (``find_latest``) and
returns the same iteration everywhere. The decision itself is :mod:`.recovery`'s pure
functions; this module does the reading and the communication around them, all over
the coordination gloo group (:mod:`megatron_async.core.coordination`), each collective
bounded by its timeout:

1. every holder scans its directory (records only) and the scans are gathered once;
2. per complete iteration, newest first: every rank verifies its own part (reads and
   hashes it), the ranks gather which parts are intact, the holders of replicas of the
   owners still missing verify those, and :func:`~.recovery.choose_sources` plans who
   reads from whom;
3. every part a rank lacks is sent to it as one ``uint8`` tensor (its exact bytes) and
   the receiver checks the digest before keeping it; any rank's failure moves every
   rank to the next older iteration, and -1 (the persistent checkpoint) follows the last.

The verified bytes of this rank's part are kept in a :class:`Recovered`, which
:func:`deserialize` turns into the state dict as often as it is asked.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import logging
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_async.buckets.bucket_file import new_hasher
from megatron_async.core import coordination
from megatron_async.local import parts, recovery
from megatron_async.local.cliques import ExchangePlan
from megatron_async.local.parts import LocalIdentity, PartRecord
from megatron_async.local.recovery import PartKey

__all__ = ["Recovered", "recover_newest", "deserialize"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Recovered:
    """This rank's part of the recovered iteration: bytes that hashed to the owner's digest."""

    iteration: int
    data: memoryview
    """The part's bytes, exactly as the owner serialized them."""
    source: int
    """The rank whose copy it is (this rank, or the peer that sent a replica)."""


def recover_newest(directory: str, identity: LocalIdentity, rank: int) -> Optional[Recovered]:
    """Find, verify and fetch this rank's part of the newest recoverable iteration (every rank).

    Args:
        directory: this rank's holder directory.
        identity: this job's; parts of another are ignored (one log line).
        rank: this rank's global rank.

    Returns:
        The verified part, or None when no local iteration is recoverable on every rank.

    Raises:
        CoordinationError: a collective failed or timed out (a peer died).
    """
    world_size = identity.world_size
    inventories = coordination.all_gather_objects(parts.scan(directory))
    inventories = recovery.matching_identity(inventories, identity)
    own: Dict[PartKey, PartRecord] = {r.key: r for r in inventories[rank]}
    for iteration in recovery.complete_iterations(inventories, world_size):
        verified: Dict[PartKey, memoryview] = {}
        key = (iteration, rank)
        if key in own:
            _verify(directory, own[key], verified)
        intact = _gather_intact(verified)
        wanted = recovery.replicas_to_verify(iteration, inventories, intact, world_size)
        if wanted:  # the same on every rank: they all gathered the same facts
            for record in wanted.get(rank, []):
                _verify(directory, record, verified)
            intact = _gather_intact(verified)
        plan = recovery.choose_sources(iteration, intact, world_size)
        if plan is None:
            continue
        mine = _move_parts(plan, verified, inventories, rank)
        failed = coordination.all_reduce_max([int(mine is None)])[0]
        if not failed:
            logger.info(
                "rank %d: recovering local checkpoint %d from rank %d's copy",
                rank, iteration, mine.source,
            )
            return Recovered(iteration, mine.data, mine.source)
        logger.warning(
            "local checkpoint %d: a part did not arrive intact on some rank; trying an "
            "older iteration", iteration,
        )
    logger.warning("rank %d: no local checkpoint is recoverable on every rank", rank)
    return None


def _verify(directory: str, record: PartRecord, verified: Dict[PartKey, memoryview]) -> None:
    data = parts.read_verified(directory, record)
    if data is not None:
        verified[record.key] = memoryview(data)


def _gather_intact(verified: Dict[PartKey, memoryview]) -> List[set]:
    return [set(keys) for keys in coordination.all_gather_objects(sorted(verified))]


def _move_parts(
    plan: ExchangePlan,
    verified: Dict[PartKey, memoryview],
    inventories: Sequence[Sequence[PartRecord]],
    rank: int,
) -> Optional[Recovered]:
    """Send the parts this rank holds for others and receive its own if it lacks it
    (every rank, the plan in the same order everywhere): one ``uint8`` tensor per part,
    point to point over the coordination group.

    Returns:
        This rank's part, or None when it did not arrive intact (logged).
    """
    group = coordination.get_coordination_group()
    timeout = datetime.timedelta(seconds=coordination.coordination_timeout_s())
    works, mine, expected = [], None, None
    try:
        for entry in plan.entries:
            if entry.receiver == rank and entry.sender == rank:
                mine = Recovered(entry.id_[0], verified[entry.id_], rank)
            elif entry.sender == rank:
                tensor = torch.frombuffer(verified[entry.id_], dtype=torch.uint8)
                works.append(dist.isend(tensor, entry.receiver, group=group))
            elif entry.receiver == rank:
                expected = next(r for r in inventories[entry.sender] if r.key == entry.id_)
                buffer = torch.empty(expected.num_bytes, dtype=torch.uint8)
                works.append(dist.irecv(buffer, entry.sender, group=group))
                mine = Recovered(entry.id_[0], memoryview(buffer.numpy()), entry.sender)
        for work in works:
            work.wait(timeout)
    except Exception as exc:  # agreed on by the caller: every rank tries an older iteration
        logger.warning("rank %d: moving local checkpoint parts failed: %s", rank, exc)
        return None
    if expected is not None and mine is not None:
        hasher = new_hasher()
        hasher.update(mine.data)
        if hasher.hexdigest() != expected.digest:
            logger.warning(
                "rank %d: its part of local checkpoint %d from rank %d hashes to %s, not %s "
                "(damaged on its way): not used", rank, expected.iteration, mine.source,
                hasher.hexdigest(), expected.digest,
            )
            return None
    return mine


class _MemoryReader(io.RawIOBase):
    """A read-only, seekable file over bytes in memory, so that ``torch.load`` reads the
    verified part in place (``io.BytesIO`` would copy it first)."""

    def __init__(self, data: memoryview):
        self._data = data.cast("B")
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        target = memoryview(buffer).cast("B")
        count = max(min(target.nbytes, self._data.nbytes - self._position), 0)
        target[:count] = self._data[self._position : self._position + count]
        self._position += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._data.nbytes}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position


def deserialize(part: Recovered):
    """The state dict in ``part``'s bytes, its tensors back on their devices (every rank).

    Trusted: the bytes hashed to the digest their owner recorded when it wrote them, so
    the full unpickler (``weights_only=False``) runs on this job's own output only.
    """
    state = torch.load(_MemoryReader(part.data), weights_only=False)
    restore = getattr(state, "restore_tensor_device", None)
    if callable(restore):
        restore(non_blocking=False)
    return state
