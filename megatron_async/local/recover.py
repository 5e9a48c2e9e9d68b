"""Recover a local checkpoint: one agreed decision, verified bytes, bulk moves (every rank).

:func:`recover_newest` runs on every rank at the same point (``find_latest``) and
returns the same iteration everywhere. The decision itself is :mod:`.recovery`'s pure
functions; this module does the reading and the communication around them, all over
the coordination gloo group (:mod:`megatron_async.core.coordination`), each collective
bounded by its timeout:

1. every rank's identity and scan of its holder directory (records only) are gathered
   once; rank 0's identity decides, and when some rank's differs nothing is recovered;
2. per complete iteration, newest first: every rank verifies its own part (hashes it as
   it streams), the ranks gather which parts are intact, the holders of replicas of the
   owners still missing verify those, and :func:`~.recovery.next_step` plans who reads
   from whom;
3. every part a rank lacks is read by the holder chosen to send it and sent as one
   ``uint8`` tensor (its exact bytes), all within one deadline; the receiver checks the
   digest, and once every rank has its part, writes it back to its holder directory.
   A damaged transfer moves every rank to the next older iteration; a wait that ran out
   ends the recovery on every rank; -1 (the persistent checkpoint) follows.

The moves of one plan run on a gloo group of their own, created by the ranks that send
or receive (:func:`~megatron_async.core.coordination.new_transfer_group`) and destroyed
once every rank agreed on how they went: an operation a timeout left posted goes with it
and never meets a later collective or recovery on the coordination group.

Memory: verifying a rank's own part streams through one 8 MiB buffer; a holder keeps the
replicas it verifies for missing owners (usually one: the lost node's rank of its clique)
until the move, and sends them from there; a receiver holds its own part, which it keeps
after writing it back, for :func:`deserialize` (a rank of a lost node holds its part until
``load``). A copy on disk is named by :class:`Recovered`; :func:`deserialize` verifies it
again and maps it, as often as it is asked.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import logging
import os
import time
from typing import Dict, List, Optional, Sequence, Set

import secrets

import torch
import torch.distributed as dist

from megatron_async.buckets.bucket_file import new_hasher
from megatron_async.core import coordination
from megatron_async.errors import LocalCheckpointError
from megatron_async.local import part_output, parts, recovery
from megatron_async.local.cliques import ExchangePlan
from megatron_async.local.parts import LocalIdentity, PartRecord
from megatron_async.local.recovery import PartKey

__all__ = ["Recovered", "recover_newest", "deserialize"]

logger = logging.getLogger(__name__)

_MOVE_SHARE = 0.8
"""The share of ``coordination_timeout_s`` the moving ranks have to connect and move the
parts: the ranks that move nothing wait in the agreement after it, bounded by the whole."""


@dataclasses.dataclass(frozen=True)
class Recovered:
    """This rank's part of the recovered iteration: a copy that hashed to the owner's digest."""

    iteration: int
    record: PartRecord
    """The part's record (size and the owner's digest)."""
    source: int
    """The holder whose copy it is: this rank (its own part), or the peer that sent the
    replica of this rank's part it keeps."""
    directory: str
    """This rank's holder directory, where the verified copy lies (its own, or written back)."""
    data: Optional[memoryview] = None
    """The bytes of a part received from a peer (kept after the write-back, so that
    ``load`` does not read them back from disk); None for a copy on this rank's disk."""
    written_back: bool = False
    """A part received from a peer is in this rank's holder directory again."""

    def describe(self) -> str:
        """Which copy this is, for a log line: its own part, or a peer's replica of it."""
        if self.source == self.record.owner:
            return "its own part"
        kept = "written back" if self.written_back else "kept in memory only"
        return f"the replica of its part held by rank {self.source} ({kept})"


def recover_newest(directory: str, identity: LocalIdentity, rank: int) -> Optional[Recovered]:
    """Find, verify and fetch this rank's part of the newest recoverable iteration (every rank).

    Args:
        directory: this rank's holder directory.
        identity: this job's, as this rank knows it; rank 0's decides for every rank.
        rank: this rank's global rank.

    Returns:
        The verified part, or None when no local iteration is recoverable on every rank
        (or the ranks' identities differ, or a move between ranks timed out).

    Raises:
        CoordinationError: a collective failed or timed out (a peer died).
    """
    nonce = secrets.token_hex(8) if rank == 0 else None  # names this recovery's groups
    gathered = coordination.all_gather_objects((identity, parts.scan(directory), nonce))
    agreed = recovery.agreed_identity([found[0] for found in gathered])
    if agreed is None:
        return None
    if not any(found[1] for found in gathered):
        logger.info("rank %d: no local checkpoint on any rank (a fresh job)", rank)
        return None
    group_name = f"megatron_async_local_recovery_{gathered[0][2]}"
    world_size = agreed.world_size
    inventories = recovery.matching_identity([found[1] for found in gathered], agreed)
    own = {r.key: r for r in inventories[rank]}
    for iteration in recovery.complete_iterations(inventories, world_size):
        verified = _verify(directory, [own[(iteration, rank)]] if (iteration, rank) in own else [])
        intact = _gather_intact(verified)
        step = recovery.next_step(iteration, inventories, intact, world_size, False)
        held: Dict[PartKey, memoryview] = {}  # replicas verified in memory, to send
        if step.verify:  # the same on every rank: they all gathered the same facts
            verified |= _verify(directory, step.verify.get(rank, []), held)
            intact = _gather_intact(verified)
            step = recovery.next_step(iteration, inventories, intact, world_size, True)
        if step.plan is None:
            continue
        # The movers connect and move within one deadline, short of the bound of the
        # agreement the other ranks already wait in.
        deadline = time.monotonic() + _MOVE_SHARE * coordination.coordination_timeout_s()
        group, stuck = _open_transfer_group(step.plan, f"{group_name}_{iteration}", rank, deadline)
        try:
            mine, damaged = None, False
            if not stuck:
                mine, damaged, stuck = _move_parts(
                    step.plan, group, directory, inventories, rank, held, deadline
                )
            damaged, stuck = coordination.all_reduce_max([int(damaged), int(stuck)])
        finally:  # every rank's operations ended: what a timeout left posted goes too
            held.clear()
            if group is not None:
                dist.destroy_process_group(group)
        if stuck:
            logger.error(
                "rank %d: moving the parts of local checkpoint %d did not finish in time on "
                "some rank: no local checkpoint is recovered", rank, iteration,
            )
            return None
        if not damaged:
            return _write_back(mine) if mine.data is not None else mine
        logger.warning(
            "local checkpoint %d: a part did not arrive intact on some rank; trying an "
            "older iteration", iteration,
        )
    logger.warning(
        "rank %d: local checkpoint parts exist, but no iteration is recoverable on every rank",
        rank,
    )
    return None


def _verify(
    directory: str, records: Sequence[PartRecord], held: Optional[Dict[PartKey, memoryview]] = None
) -> Set[PartKey]:
    """The keys of ``records`` whose parts hash to their digests; any error (a full
    memory, a vanished disk) counts as not intact, logged, so every rank still agrees.

    With ``held``, each intact part's bytes are kept there: the replicas a holder verifies
    for a missing owner, which it is then likely to send (read once, not twice)."""
    intact = set()
    for record in records:
        try:
            if held is None:
                if parts.verify_part(directory, record):
                    intact.add(record.key)
            elif (data := parts.read_verified(directory, record)) is not None:
                held[record.key] = memoryview(data)
                intact.add(record.key)
        except Exception as exc:
            logger.warning(
                "%s: cannot verify rank %d's local checkpoint part of iteration %d, not "
                "used: %s: %s", directory, record.owner, record.iteration, type(exc).__name__, exc,
            )
    return intact


def _gather_intact(verified: Set[PartKey]) -> List[set]:
    return [set(keys) for keys in coordination.all_gather_objects(sorted(verified))]


def _open_transfer_group(plan: ExchangePlan, name: str, rank: int, deadline: float):
    """The group of the ranks that send or receive a part in ``plan``, created by them
    (every rank: the others, and every rank when nothing moves, get None).

    Returns:
        ``(group or None, stuck)``: stuck when a rank of the group did not create it in time.
    """
    moves = [(e.sender, e.receiver) for e in plan.entries if e.sender != e.receiver]
    movers = sorted({r for move in moves for r in move})
    if rank not in movers:
        return None, False
    timeout_s = max(deadline - time.monotonic(), 1e-3)
    try:
        return coordination.new_transfer_group(name, movers, timeout_s), False
    except Exception as exc:  # agreed on by the caller: nothing is recovered
        logger.error("rank %d: cannot connect to the ranks moving parts: %s", rank, exc)
        return None, True


def _move_parts(
    plan: ExchangePlan, group: Optional[dist.ProcessGroup], directory: str,
    inventories: Sequence[Sequence[PartRecord]], rank: int, held: Dict[PartKey, memoryview],
    deadline: float,
):
    """Send the parts this rank holds for others and receive its own if it lacks it
    (every rank, the plan in the same order everywhere), point to point over ``group``
    (:func:`_open_transfer_group`) by ``deadline`` (``time.monotonic()``). Its receive is posted before any
    send is waited for, and its sends go one at a time, each part from the bytes verified
    in ``held``, else read (and verified) just before.

    Returns:
        ``(this rank's part or None, damaged, stuck)``: damaged when a part did not hash
        to its digest (every operation finished), stuck when a wait failed or ran out.
    """
    mine, receive, damaged = None, None, False
    try:
        for entry in plan.entries:
            if entry.receiver != rank:
                continue
            record = next(r for r in inventories[entry.sender] if r.key == entry.id_)
            mine = Recovered(entry.id_[0], record, entry.sender, directory)
            if entry.sender != rank:
                buffer = torch.empty(record.num_bytes, dtype=torch.uint8)
                receive = (dist.irecv(buffer, entry.sender, group=group), buffer)
        for entry in plan.entries:
            if entry.sender == rank and entry.receiver != rank:
                record = next(r for r in inventories[rank] if r.key == entry.id_)
                data = held.pop(record.key, None) or parts.read_verified(directory, record)
                if data is None:  # changed since verified: the receiver's digest check fails
                    data, damaged = bytearray(record.num_bytes), True
                tensor = torch.frombuffer(data, dtype=torch.uint8)
                _wait(dist.isend(tensor, entry.receiver, group=group), deadline)
                del tensor, data
        if receive is not None:
            _wait(receive[0], deadline)
    except Exception as exc:  # agreed on by the caller: nothing is recovered
        logger.error("rank %d: moving local checkpoint parts failed: %s", rank, exc)
        return None, damaged, True
    if receive is not None:
        mine = dataclasses.replace(mine, data=memoryview(receive[1].numpy()))
        hasher = new_hasher()
        hasher.update(mine.data)
        if hasher.hexdigest() != mine.record.digest:
            logger.warning(
                "rank %d: its part of local checkpoint %d from rank %d hashes to %s, not %s "
                "(damaged on its way): not used", rank, mine.iteration, mine.source,
                hasher.hexdigest(), mine.record.digest,
            )
            return None, True, False
    return mine, damaged, False


def _wait(work, deadline: float) -> None:
    """Wait for a point-to-point operation until ``deadline`` (``time.monotonic()``)."""
    timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
    if work.wait(timeout) is False:
        raise TimeoutError(f"a point-to-point operation did not finish within {timeout}")


def _write_back(part: Recovered) -> Recovered:
    """Write a part received from a peer into this rank's holder directory, so that the
    part has its copies again before the next save (every rank that received one). The
    bytes stay in memory for ``load`` either way; a failed write is logged."""
    record = part.record
    try:
        part_output.write_part(
            part.directory, record.iteration, record.owner, [part.data], record.identity,
            expected_digest=record.digest,
        )
    except Exception as exc:
        logger.warning(
            "rank %d: cannot write its recovered local checkpoint part of iteration %d back "
            "to %s (kept in memory): %s", record.owner, record.iteration, part.directory, exc,
        )
        return part
    return dataclasses.replace(part, written_back=True)


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

    A copy on this rank's disk is verified again (read and hashed through one 8 MiB
    buffer: an unreadable sector is an error here), then loaded with
    ``torch.load(mmap=True)``: its tensors map the file's pages, just read, privately
    (changing them writes nothing back; each call gets its own), so no copy of the part is
    made (should the pages be evicted and the disk fail before the tensors are used, the
    process gets ``SIGBUS``, as with any mapped file). A part received from a peer is
    deserialized from its bytes in memory. Trusted:
    the bytes hash to the digest their owner recorded, so the full unpickler
    (``weights_only=False``) runs on this job's own output only.

    Raises:
        LocalCheckpointError: the copy changed or vanished since it was verified.
    """
    if part.data is not None:
        state = torch.load(_MemoryReader(part.data), weights_only=False)
    else:
        if not parts.verify_part(part.directory, part.record):
            raise LocalCheckpointError(
                f"rank {part.record.owner}'s local checkpoint part of iteration "
                f"{part.iteration} in {part.directory} changed or vanished after find_latest "
                "verified it (see the line above); call find_latest() again"
            )
        path = os.path.join(part.directory, parts.part_name(part.iteration, part.record.owner))
        state = torch.load(path, mmap=True, weights_only=False)
    restore = getattr(state, "restore_tensor_device", None)
    if callable(restore):
        restore(non_blocking=False)
    return state
