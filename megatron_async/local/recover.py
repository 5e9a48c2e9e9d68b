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
3. every rank that lacks its part opens its file in its holder directory, and the ranks
   agree that all could (else the recovery ends on every rank, before anything moves);
   then every missing part is sent by the holder chosen to send it as one ``uint8``
   tensor (its exact bytes), all within one deadline, received straight into that file; the receiver checks the digest of
   the pages it received and writes the part back (fsync, rename, record). Then the
   ranks agree on how it went: a damaged transfer moves every rank to the next older
   iteration; a wait that ran out, or a part that could not be written back, ends the
   recovery on every rank; -1 (the persistent checkpoint) follows.

The moves of one plan run on a gloo group of their own, created by the ranks that send
or receive (:func:`~megatron_async.core.coordination.new_transfer_group`) and destroyed
once every rank agreed on how they went: an operation a timeout left posted goes with it
and never meets a later collective or recovery on the coordination group.

Memory: no part is copied into a process's own memory. Verifying streams through one
8 MiB buffer (``read``: an unreadable sector counts as damaged; a mapping would get
``SIGBUS``), which leaves the part's pages in the page cache; a holder sends a replica
from a private mapping of its file (those pages), and a receiver receives its part into
a shared mapping of its own part's file. :func:`deserialize` maps the part's file
(``torch.load(mmap=True)``), the same pages, as often as it is asked; it hashes the file
again only when the file's :class:`~.parts.FileVersion` changed since it was verified.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import secrets

import torch
import torch.distributed as dist

from megatron_async.core import coordination
from megatron_async.errors import LocalCheckpointError
from megatron_async.local import part_output, parts, recovery
from megatron_async.local.cliques import ExchangePlan
from megatron_async.local.parts import FileVersion, LocalIdentity, PartRecord
from megatron_async.local.recovery import PartKey

__all__ = ["Recovered", "recover_newest", "deserialize"]

logger = logging.getLogger(__name__)

_MOVE_SHARE = 0.8
"""The share of ``coordination_timeout_s`` the moving ranks have to connect and move the
parts: the ranks that move nothing wait in the agreement after it, bounded by the whole."""


@dataclasses.dataclass(frozen=True)
class Recovered:
    """This rank's part of the recovered iteration: a file that hashed to the owner's digest."""

    iteration: int
    record: PartRecord
    """The part's record (size and the owner's digest)."""
    source: int
    """The holder whose copy it is: this rank (its own part), or the peer that sent the
    replica of this rank's part, now written back."""
    directory: str
    """This rank's holder directory, where the verified copy lies (its own, or written back)."""
    version: FileVersion
    """The part's file as it was when its bytes hashed to the digest."""

    def describe(self) -> str:
        """Which copy this is, for a log line: its own part, or a peer's replica of it."""
        if self.source == self.record.owner:
            return "its own part"
        return f"the replica of its part held by rank {self.source} (written back)"


def recover_newest(directory: str, identity: LocalIdentity, rank: int) -> Optional[Recovered]:
    """Find, verify and fetch this rank's part of the newest recoverable iteration (every rank).

    Args:
        directory: this rank's holder directory.
        identity: this job's, as this rank knows it; rank 0's decides for every rank.
        rank: this rank's global rank.

    Returns:
        The verified part, or None when no local iteration is recoverable on every rank
        (or the ranks' identities differ, or a receiver could not open its part's file,
        or a move between ranks timed out, or a received part could not be written back).

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
        if step.verify:  # the same on every rank: they all gathered the same facts
            verified.update(_verify(directory, step.verify.get(rank, [])))
            intact = _gather_intact(verified)
            step = recovery.next_step(iteration, inventories, intact, world_size, True)
        if step.plan is None:
            continue
        incoming = _open_incoming(step.plan, directory, inventories, rank)
        posted: list = []  # a receive a timeout left posted writes into its part's mapping
        try:
            if coordination.all_reduce_max([int(incoming is False)])[0]:
                logger.error(
                    "rank %d: some rank cannot write its part of local checkpoint %d (see its "
                    "log): no local checkpoint is recovered", rank, iteration,
                )
                return None
            # The movers connect and move within one deadline, short of the bound of the
            # agreement the other ranks already wait in.
            deadline = time.monotonic() + _MOVE_SHARE * coordination.coordination_timeout_s()
            group, failed = _open_transfer_group(
                step.plan, f"{group_name}_{iteration}", rank, deadline
            )
            try:
                mine, damaged = None, False
                if not failed:
                    mine, received, damaged, failed = _move_parts(
                        step.plan, group, directory, inventories, rank, verified, incoming,
                        deadline, posted,
                    )
                    if received is not None:
                        mine = _write_back(*received)
                        failed = mine is None
                damaged, failed = coordination.all_reduce_max([int(damaged), int(failed)])
            finally:  # every rank's operations ended: what a timeout left posted goes too
                if group is not None:
                    dist.destroy_process_group(group)
        finally:  # a part committed has no dirty file left: discarding it only unmaps
            if incoming:
                incoming[1].discard()
            posted.clear()
        if failed:
            logger.error(
                "rank %d: moving the parts of local checkpoint %d did not finish in time, or "
                "a part could not be written back, on some rank: no local checkpoint is "
                "recovered", rank, iteration,
            )
            return None
        if not damaged:
            return mine
        logger.warning(
            "local checkpoint %d: a part did not arrive intact on some rank; trying an "
            "older iteration", iteration,
        )
    logger.warning(
        "rank %d: local checkpoint parts exist, but no iteration is recoverable on every rank",
        rank,
    )
    return None


def _verify(directory: str, records: Sequence[PartRecord]) -> Dict[PartKey, FileVersion]:
    """The keys of ``records`` whose parts hash to their digests, with their files'
    versions; any error (a vanished disk) counts as not intact, logged, so every rank
    still agrees."""
    intact = {}
    for record in records:
        try:
            version = parts.verify_part(directory, record)
        except Exception as exc:
            logger.warning(
                "%s: cannot verify rank %d's local checkpoint part of iteration %d, not "
                "used: %s: %s", directory, record.owner, record.iteration, type(exc).__name__, exc,
            )
            continue
        if version is not None:
            intact[record.key] = version
    return intact


def _gather_intact(verified: Dict[PartKey, FileVersion]) -> List[set]:
    return [set(keys) for keys in coordination.all_gather_objects(sorted(verified))]


def _open_transfer_group(plan: ExchangePlan, name: str, rank: int, deadline: float):
    """The group of the ranks that send or receive a part in ``plan``, created by them
    (every rank: the others, and every rank when nothing moves, get None).

    Returns:
        ``(group or None, failed)``: failed when a rank of the group did not create it in time.
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


def _open_incoming(
    plan: ExchangePlan, directory: str, inventories: Sequence[Sequence[PartRecord]], rank: int,
):
    """``(sender, IncomingPart)`` when ``plan`` moves this rank's part to it, None when
    nothing comes, False (logged) when its file cannot be made (a full or unwritable
    disk): every rank agrees on that before anything moves (every rank)."""
    for entry in plan.entries:
        if entry.receiver != rank or entry.sender == rank:
            continue
        try:
            record = next(r for r in inventories[entry.sender] if r.key == entry.id_)
            return entry.sender, part_output.IncomingPart(directory, record)
        except Exception as exc:
            logger.error(
                "rank %d: cannot write its local checkpoint part of iteration %d to %s: %s",
                rank, entry.id_[0], directory, exc,
            )
            return False
    return None


def _move_parts(
    plan: ExchangePlan, group: Optional[dist.ProcessGroup], directory: str,
    inventories: Sequence[Sequence[PartRecord]], rank: int,
    verified: Dict[PartKey, FileVersion], incoming, deadline: float, posted: list,
):
    """Send the parts this rank holds for others and receive its own if it lacks it
    (every rank, the plan in the same order everywhere), point to point over ``group``
    (:func:`_open_transfer_group`) by ``deadline`` (``time.monotonic()``). Its receive,
    into its part's file (``incoming``, from :func:`_open_incoming`), is posted before
    any send is waited for; its sends go one at a time, each from a mapping of the
    replica's file (:func:`~.parts.map_part`) that this rank verified moments before.

    Returns:
        ``(own part kept, (sender, incoming part) received, damaged, failed)``: the
        received part hashed to its digest and still has to be written back (or None);
        damaged when a part did not hash to its digest (every operation finished);
        failed when a wait failed or ran out. An operation a timeout left posted is kept
        in ``posted`` with its tensor (which wraps a mapping), for the caller to drop once
        the group is destroyed: until then it may still write into it or read from it.
    """
    mine, receive, damaged = None, None, False
    try:
        for entry in plan.entries:
            if entry.receiver == rank and entry.sender == rank:
                record = next(r for r in inventories[rank] if r.key == entry.id_)
                mine = Recovered(entry.id_[0], record, rank, directory, verified[record.key])
        if incoming is not None:
            target = torch.frombuffer(incoming[1].buffer, dtype=torch.uint8)
            receive = (dist.irecv(target, incoming[0], group=group), target)
            posted.append(receive)
            del target
        for entry in plan.entries:
            if entry.sender == rank and entry.receiver != rank:
                record = next(r for r in inventories[rank] if r.key == entry.id_)
                data = _mapped(directory, record)
                if data is None:  # vanished or resized since verified: the receiver's check fails
                    data, damaged = bytearray(record.num_bytes), True
                tensor = torch.frombuffer(data, dtype=torch.uint8)
                send = dist.isend(tensor, entry.receiver, group=group)
                posted.append((send, tensor))  # a timed-out send may still read it
                _wait(send, deadline)
                posted.pop()
                del send, tensor, data
        if receive is not None:
            _wait(receive[0], deadline)
    except Exception as exc:  # agreed on by the caller: nothing is recovered
        logger.error("rank %d: moving local checkpoint parts failed: %s", rank, exc)
        return None, None, damaged, True
    receive = None  # done: its tensor no longer wraps the mapping
    posted.clear()
    if incoming is not None:
        part = incoming[1]
        digest = part.digest()
        if digest != part.record.digest:
            logger.warning(
                "rank %d: its part of local checkpoint %d from rank %d hashes to %s, not %s "
                "(damaged on its way): not used", rank, part.record.iteration, incoming[0],
                digest, part.record.digest,
            )
            return None, None, True, False  # the caller discards it
    return mine, incoming, damaged, False


def _mapped(directory: str, record: PartRecord):
    """A mapping of a replica to send, or None (logged) when it cannot be mapped."""
    try:
        return parts.map_part(directory, record)
    except (OSError, ValueError) as exc:
        logger.warning(
            "%s: cannot map rank %d's local checkpoint part of iteration %d to send it: %s",
            directory, record.owner, record.iteration, exc,
        )
        return None


def _wait(work, deadline: float) -> None:
    """Wait for a point-to-point operation until ``deadline`` (``time.monotonic()``)."""
    timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
    if work.wait(timeout) is False:
        raise TimeoutError(f"a point-to-point operation did not finish within {timeout}")


def _write_back(source: int, part: part_output.IncomingPart) -> Optional[Recovered]:
    """Make the part received from ``source`` durable in this rank's holder directory,
    with its record (every rank that received one), so that the part has its copies
    again before the next save; None (logged) when it cannot, which the caller agrees on."""
    record = part.record
    try:
        version = part.commit()
    except Exception as exc:
        logger.error(
            "rank %d: cannot write its recovered local checkpoint part of iteration %d back: %s",
            record.owner, record.iteration, exc,
        )
        return None
    return Recovered(record.iteration, record, source, part.directory, version)


def deserialize(part: Recovered) -> Tuple[Any, Recovered]:
    """The state dict in ``part``'s file, its tensors back on their devices (every rank).

    Loaded with ``torch.load(mmap=True)``: its tensors map the file's pages, which
    verifying or receiving it left in the page cache, privately (changing them writes
    nothing back; each call gets its own), so no copy of the part is made (should the
    pages be evicted and the disk fail before the tensors are used, the process gets
    ``SIGBUS``, as with any mapped file). The file is hashed again only when its
    :class:`~.parts.FileVersion` differs from the one verified (a write, truncation or
    replacement since); it is compared once more after the load, so that a file changed
    while it was loaded is not used either. Trusted: the bytes hash to the digest their
    owner recorded, so the full unpickler (``weights_only=False``) runs on this job's own
    output only.

    Returns:
        ``(state dict, part)``: ``part`` with the version just hashed when the file had to
        be hashed again, so that a later load does not hash it once more.

    Raises:
        LocalCheckpointError: the file changed since it was verified and no longer
            hashes to its digest, vanished, or changed while it was loaded.
    """
    record = part.record
    path = os.path.join(part.directory, parts.part_name(part.iteration, record.owner))
    version = part.version
    if parts.file_version(path) != version:
        version = parts.verify_part(part.directory, record)
        if version is None:
            raise LocalCheckpointError(
                f"rank {record.owner}'s local checkpoint part of iteration {part.iteration} "
                f"in {part.directory} changed or vanished after find_latest verified it (see "
                "the line above); call find_latest() again"
            )
    state = torch.load(path, mmap=True, weights_only=False)
    if parts.file_version(path) != version:
        raise LocalCheckpointError(
            f"rank {record.owner}'s local checkpoint part of iteration {part.iteration} in "
            f"{part.directory} changed while it was loaded; call find_latest() again"
        )
    restore = getattr(state, "restore_tensor_device", None)
    if callable(restore):
        restore(non_blocking=False)
    return state, dataclasses.replace(part, version=version)
