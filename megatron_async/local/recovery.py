"""Which local checkpoint to recover, and from where: pure decisions, no I/O.

Runs on every rank during a recovery. Each function takes what the ranks gathered
(every holder's :func:`~megatron_async.local.parts.scan`, then which parts each holder
verified intact) and returns the same answer on every rank, so the ranks agree without
another collective. The steps, per candidate iteration, newest first:

0. :func:`agreed_identity`: rank 0's identity, or nothing recovered when ranks differ.
1. :func:`matching_identity` drops the parts of another job (one log line naming both
   values); :func:`complete_iterations` lists the iterations every owner has a part of.
2. Each holder verifies its own part; :func:`next_step` (:func:`replicas_to_verify`)
   says which replicas to verify for the owners whose own copy is missing or damaged.
3. :func:`next_step` (:func:`choose_sources`) plans, for every rank, the intact copy it
   reads: its own if it has one, else the lowest-ranked holder's. No plan means some part
   has no intact copy anywhere: the next older iteration is tried, then the persistent
   checkpoint.

Parts are named by their key ``(iteration, owner)``; ``inventories`` and ``intact`` are
indexed by the holder's global rank, as ``all_gather_object`` returns them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import AbstractSet, Dict, Iterable, List, Optional, Sequence, Tuple

from megatron_async.local.cliques import ExchangePlan
from megatron_async.local.parts import LocalIdentity, PartRecord

__all__ = [
    "PartKey",
    "Step",
    "agreed_identity",
    "matching_identity",
    "complete_iterations",
    "replicas_to_verify",
    "choose_sources",
    "next_step",
]

logger = logging.getLogger(__name__)

PartKey = Tuple[int, int]
"""``(iteration, owner)``: one rank's part of one iteration, wherever it is kept."""

Inventories = Sequence[Iterable[PartRecord]]
Intact = Sequence[AbstractSet[PartKey]]


def agreed_identity(identities: Sequence[LocalIdentity]) -> Optional[LocalIdentity]:
    """Rank 0's identity when every rank has the same one (``identities`` by rank);
    else None, with one log line naming rank 0's and every differing rank's values
    (a run id or algo passed on some ranks only): nothing is recovered then."""
    differing = [f"rank {r}: {i}" for r, i in enumerate(identities) if i != identities[0]]
    if not differing:
        return identities[0]
    logger.error(
        "the ranks disagree on this job's local checkpoint identity (rank 0: %s; %s): no "
        "local checkpoint is recovered; pass the same run_id and algo on every rank",
        identities[0], "; ".join(differing),
    )
    return None


def matching_identity(inventories: Inventories, identity: LocalIdentity) -> List[List[PartRecord]]:
    """Every holder's records without those written by another job (another world size,
    replication layout, run id or algo); one warning names the first mismatch."""
    kept: List[List[PartRecord]] = []
    dropped: List[Tuple[int, PartRecord, List[str]]] = []
    for holder, records in enumerate(inventories):
        kept.append([])
        for record in records:
            differences = identity.differences(record.identity)
            if differences:
                dropped.append((holder, record, differences))
            else:
                kept[-1].append(record)
    if dropped:
        holder, record, differences = dropped[0]
        logger.warning(
            "ignoring %d local checkpoint part(s) written by another job; first: rank %d's "
            "copy of rank %d's part of iteration %d (%s; this job's value first)",
            len(dropped), holder, record.owner, record.iteration, ", ".join(differences),
        )
    return kept


def complete_iterations(inventories: Inventories, world_size: int) -> List[int]:
    """The iterations of which every owner ``0..world_size-1`` has a part on some holder,
    newest first. Nothing is verified here: a complete iteration may still be damaged."""
    owners: Dict[int, set] = {}
    for records in inventories:
        for record in records:
            if 0 <= record.owner < world_size:
                owners.setdefault(record.iteration, set()).add(record.owner)
    return sorted((i for i, found in owners.items() if len(found) == world_size), reverse=True)


def replicas_to_verify(
    iteration: int, inventories: Inventories, intact: Intact, world_size: int
) -> Dict[int, List[PartRecord]]:
    """The replicas each holder verifies next: those of the owners of ``iteration`` whose
    own copy is not in ``intact`` (missing or damaged).

    Args:
        intact: per holder, the parts it verified intact so far (each owner's own part).

    Returns:
        Holder -> the records of the replicas it reads and hashes; holders with none
        are left out.
    """
    wanted = {o for o in range(world_size) if not _holds(intact, o, (iteration, o))}
    found: Dict[int, List[PartRecord]] = {}
    for holder, records in enumerate(inventories):
        for record in records:
            if record.iteration == iteration and record.owner in wanted and record.owner != holder:
                found.setdefault(holder, []).append(record)
    return found


def choose_sources(iteration: int, intact: Intact, world_size: int) -> Optional[ExchangePlan]:
    """Plan where every rank reads its part of ``iteration`` from, or None if it cannot.

    Rank ``r`` reads its own copy when it verified it intact, else the copy of the
    lowest-ranked holder that verified one (the same choice on every rank).

    Returns:
        A plan with one entry per rank (``id_`` is the part's key; sender == receiver
        for an own copy), or None when some owner has no intact copy anywhere (logged).
    """
    plan = ExchangePlan()
    for receiver in range(world_size):
        key = (iteration, receiver)
        if _holds(intact, receiver, key):
            plan.plan(receiver, receiver, key)
            continue
        holders = [h for h in range(len(intact)) if key in intact[h]]
        if not holders:
            logger.warning(
                "local checkpoint of iteration %d cannot be recovered: no intact copy of "
                "rank %d's part on any rank", iteration, receiver,
            )
            return None
        plan.plan(holders[0], receiver, key)
    return plan


@dataclasses.dataclass(frozen=True)
class Step:
    """What every rank does next with one candidate iteration."""

    verify: Dict[int, List[PartRecord]]
    """Holder -> the replicas it verifies first (empty: go on with ``plan``)."""
    plan: Optional[ExchangePlan]
    """Where each rank reads its part; None with nothing to verify: try an older iteration."""


def next_step(
    iteration: int, inventories: Inventories, intact: Intact, world_size: int,
    replicas_verified: bool,
) -> Step:
    """The decision for ``iteration`` at one point of the recovery: after each holder
    verified its own part (``replicas_verified`` False), then, if replicas were wanted,
    after their holders verified them too (True).

    Args:
        inventories: every holder's records, already through :func:`matching_identity`.
        intact: per holder, the parts of ``iteration`` it verified intact so far.
    """
    if not replicas_verified:
        wanted = replicas_to_verify(iteration, inventories, intact, world_size)
        if wanted:
            return Step(wanted, None)
    return Step({}, choose_sources(iteration, intact, world_size))


def _holds(intact: Intact, holder: int, key: PartKey) -> bool:
    return holder < len(intact) and key in intact[holder]
