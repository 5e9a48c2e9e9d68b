"""Which ranks keep copies of which rank's local checkpoint part: replication cliques.

Runs on every rank, in the training process. A clique is a tuple of global ranks; every
member keeps its own part and a replica of every other member's part, so a part exists
``replication_factor`` times. :func:`parse_group_sequence` cuts the world into cliques
``{n, n+J, ..., n+(F-1)J}``: with ``J`` the ranks per node, the members sit on ``F``
different nodes, and a lost node loses one copy of each part it held.

No process group is created here. The parts travel between background writers over
their own connections, and a recovery moves missing parts over the coordination group;
:class:`GroupWrapper`, :class:`ExchangePlan` and :class:`ExchangePlanEntry` keep the
names Megatron-LM and nvidia-resiliency-ext's users import.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import os
from typing import Any, Generic, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import torch.distributed as dist

from megatron_async.errors import (
    CheckpointValidationError,
    LocalCheckpointError,
    NoReplicasAvailableError,
)

__all__ = [
    "ReplicationStrategy",
    "CliqueReplicationStrategy",
    "LazyReplicationStrategyBuilder",
    "LazyCliqueReplicationStrategy",
    "NoReplicasAvailableError",
    "GroupWrapper",
    "ProcessGroupLike",
    "ExchangePlan",
    "ExchangePlanEntry",
    "parse_group_sequence",
    "batched",
]

T = TypeVar("T")


def batched(iterable: Iterable[T], n: int) -> Iterator[Tuple[T, ...]]:
    """Yield tuples of ``n`` consecutive items (the last one may be shorter)."""
    if n < 1:
        raise CheckpointValidationError(f"batched needs a batch size of at least 1, not {n}")
    items = iter(iterable)
    while batch := tuple(itertools.islice(items, n)):
        yield batch


def parse_group_sequence(
    replication_jump: int, replication_factor: int, world_size: int
) -> List[Tuple[int, ...]]:
    """Cut ranks ``0..world_size-1`` into the replication cliques, sorted.

    For each residue ``m < J`` the ranks ``m, m+J, m+2J, ...`` are cut into consecutive
    cliques of ``F``. With ``W=4, J=2, F=2``: ``[(0, 2), (1, 3)]``.

    Raises:
        CheckpointValidationError: ``J`` or ``F`` below 1, or ``W`` not a multiple of
            ``J*F``; the message says what to pass.
    """
    jump, factor = replication_jump, replication_factor
    if not isinstance(jump, int) or jump < 1:
        raise CheckpointValidationError(
            f"replication jump {jump!r} must be a positive integer: pass --replication-jump "
            "(replication_jump) as the number of ranks per node"
        )
    if not isinstance(factor, int) or factor < 1:
        raise CheckpointValidationError(
            f"replication factor {factor!r} must be a positive integer: pass "
            "--replication-factor (replication_factor) as the number of copies of each part, "
            "at most the number of nodes"
        )
    if world_size % (jump * factor):
        raise CheckpointValidationError(
            f"world size {world_size} is not a multiple of replication jump x factor = "
            f"{jump} x {factor}: pass --replication-jump as the ranks per node and a "
            f"--replication-factor that divides the number of nodes ({world_size} // {jump})"
        )
    cliques = []
    for residue in range(jump):
        cliques.extend(batched(range(residue, world_size, jump), factor))
    return sorted(cliques)


ProcessGroupLike = Union["GroupWrapper", "dist.ProcessGroup"]


class GroupWrapper:
    """A process group (default: the whole world) seen through its global ranks.

    Runs on every rank of the group. It answers rank questions and gathers small objects;
    local checkpoint replication does *not* go through it (parts move between background
    writers, see the module docstring).

    Args:
        group: a ``torch.distributed`` process group; None for the default group.
    """

    def __init__(self, group: Optional["dist.ProcessGroup"] = None):
        self._group = group

    @staticmethod
    def wrap(group: Optional[ProcessGroupLike]) -> "GroupWrapper":
        """``group`` itself if it is a wrapper, else a wrapper around it."""
        return group if isinstance(group, GroupWrapper) else GroupWrapper(group)

    @staticmethod
    def from_list_of_groups(list_of_groups: Sequence["dist.ProcessGroup"]) -> "GroupWrapper":
        """The one group of ``list_of_groups`` that this rank belongs to, wrapped."""
        mine = [g for g in list_of_groups if g not in (None, dist.GroupMember.NON_GROUP_MEMBER)]
        mine = [g for g in mine if dist.get_rank() in dist.get_process_group_ranks(g)]
        if len(mine) != 1:
            raise LocalCheckpointError(
                f"rank {dist.get_rank()} belongs to {len(mine)} of the given groups; "
                "pass groups that partition the ranks (each rank in exactly one)"
            )
        return GroupWrapper(mine[0])

    @property
    def group(self) -> Optional["dist.ProcessGroup"]:
        return self._group

    @property
    def ranks(self) -> List[int]:
        """The global ranks of the group, in group-rank order."""
        if self._group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(self._group))

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    @property
    def my_group_rank(self) -> int:
        return dist.get_rank(self._group)

    @property
    def my_global_rank(self) -> int:
        return dist.get_rank()

    def get_group_rank(self, global_rank: Optional[int] = None) -> int:
        """The group rank of ``global_rank`` (this rank's if None)."""
        return self.ranks.index(self.my_global_rank if global_rank is None else global_rank)

    def get_global_rank(self, group_rank: Optional[int] = None) -> int:
        """The global rank of ``group_rank`` (this rank's if None)."""
        return self.ranks[self.my_group_rank if group_rank is None else group_rank]

    def all_gather_object(self, my_obj: T) -> List[T]:
        """Every member's ``my_obj``, in group-rank order (collective in the group)."""
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, my_obj, group=self._group)
        return gathered

    def __repr__(self) -> str:
        return f"GroupWrapper(ranks={self.ranks})"


@dataclasses.dataclass(frozen=True)
class ExchangePlanEntry:
    """One part to move: ``sender`` gives the part ``id_`` to ``receiver`` (global ranks;
    the same rank on both sides reads its own copy)."""

    sender: int
    receiver: int
    id_: Any


class ExchangePlan:
    """The parts a recovery moves between ranks, the same list on every rank."""

    def __init__(self, entries: Iterable[ExchangePlanEntry] = ()):
        self._entries: List[ExchangePlanEntry] = list(entries)

    def plan(self, sender: int, receiver: int, id_: Any) -> None:
        """Add a move of ``id_`` from ``sender`` to ``receiver``."""
        self._entries.append(ExchangePlanEntry(sender, receiver, id_))

    @property
    def entries(self) -> Tuple[ExchangePlanEntry, ...]:
        return tuple(self._entries)

    def required_ids(self, rank: int) -> List[Any]:
        """The ids ``rank`` must read from its directory: those it sends (itself included)."""
        return sorted({e.id_ for e in self._entries if e.sender == rank})

    def received_by(self, rank: int) -> List[ExchangePlanEntry]:
        """The moves whose receiver is ``rank``."""
        return [e for e in self._entries if e.receiver == rank]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExchangePlan) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"ExchangePlan({self._entries!r})"


class ReplicationStrategy(abc.ABC):
    """Where the replicas of each rank's local checkpoint part are kept (every rank).

    Only symmetric layouts are described: a rank keeps a replica of every peer's part and
    every peer keeps one of its own.
    """

    @abc.abstractmethod
    def peers(self, rank: int) -> Tuple[int, ...]:
        """The other global ranks that exchange replicas with ``rank``."""


class CliqueReplicationStrategy(ReplicationStrategy):
    """Every member of a clique keeps a replica of every other member's part.

    Args:
        local_group: this rank's clique: its global ranks, or a process group (or
            :class:`GroupWrapper`) whose ranks it is. No communication goes through it.
        target_device: accepted for nvidia-resiliency-ext's signature; replicas are
            always kept as bytes on the holder's disk.
        replication_jump: recorded in the checkpoint's identity; None to derive it from
            the clique (the distance between its members).
    """

    def __init__(
        self,
        local_group: Union[Sequence[int], ProcessGroupLike],
        target_device: str = "cpu",
        *,
        replication_jump: Optional[int] = None,
    ):
        if isinstance(local_group, (list, tuple, range)):
            ranks = [int(r) for r in local_group]
        else:
            ranks = GroupWrapper.wrap(local_group).ranks
        if not ranks or len(set(ranks)) != len(ranks):
            raise CheckpointValidationError(f"a clique needs distinct ranks, not {ranks}")
        self.clique: Tuple[int, ...] = tuple(sorted(ranks))
        self.target_device = target_device
        if replication_jump is None and len(self.clique) > 1:
            replication_jump = self.clique[1] - self.clique[0]
        self.replication_jump = replication_jump

    @property
    def replication_factor(self) -> int:
        """How many copies of each part exist: the clique's size."""
        return len(self.clique)

    def peers(self, rank: int) -> Tuple[int, ...]:
        if rank not in self.clique:
            raise LocalCheckpointError(
                f"rank {rank} is not in the replication clique {self.clique}"
            )
        return tuple(r for r in self.clique if r != rank)

    @classmethod
    def from_replication_params(
        cls,
        replication_jump: Optional[int] = None,
        replication_factor: int = 2,
        *,
        world_size: Optional[int] = None,
        rank: Optional[int] = None,
    ) -> "CliqueReplicationStrategy":
        """The clique of this rank for jump ``J`` and factor ``F`` (every rank).

        Args:
            replication_jump: ranks per node; None reads ``LOCAL_WORLD_SIZE`` (torchrun).
            replication_factor: copies of each part, on as many nodes.
            world_size, rank: for a process without ``torch.distributed``; read from the
                default process group when None.

        Raises:
            CheckpointValidationError: no jump given nor in the environment, or a jump and
                factor that do not fit the world size.
        """
        if replication_jump is None:
            replication_jump = _ranks_per_node_from_env()
        if world_size is None or rank is None:
            if not dist.is_initialized():
                raise LocalCheckpointError(
                    "CliqueReplicationStrategy.from_replication_params needs the world size "
                    "and rank: call it after torch.distributed.init_process_group, or pass "
                    "world_size= and rank="
                )
            world_size = dist.get_world_size() if world_size is None else world_size
            rank = dist.get_rank() if rank is None else rank
        cliques = parse_group_sequence(replication_jump, replication_factor, world_size)
        mine = [c for c in cliques if rank in c]
        if not mine:
            raise CheckpointValidationError(
                f"rank {rank} is outside the world of {world_size} ranks"
            )
        return cls(mine[0], replication_jump=replication_jump)

    def __repr__(self) -> str:
        return f"CliqueReplicationStrategy(clique={self.clique}, jump={self.replication_jump})"


def _ranks_per_node_from_env() -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    found = f"is {value!r}" if value else "is not set"
    raise CheckpointValidationError(
        f"no replication jump given and LOCAL_WORLD_SIZE {found}: pass --replication-jump "
        "(replication_jump) as the number of ranks per node"
    )


EagerT = TypeVar("EagerT", bound=ReplicationStrategy)


class LazyReplicationStrategyBuilder(ReplicationStrategy, Generic[EagerT]):
    """A strategy built on first use (after the process group exists), then delegated to."""

    def __init__(self) -> None:
        self._strategy: Optional[EagerT] = None

    @property
    def replication_strategy(self) -> EagerT:
        if self._strategy is None:
            self._strategy = self._eager_build()
        return self._strategy

    def peers(self, rank: int) -> Tuple[int, ...]:
        return self.replication_strategy.peers(rank)

    @abc.abstractmethod
    def _eager_build(self) -> EagerT:
        """Build the strategy delegated to."""


class LazyCliqueReplicationStrategy(LazyReplicationStrategyBuilder[CliqueReplicationStrategy]):
    """:meth:`CliqueReplicationStrategy.from_replication_params`, called on first use."""

    def __init__(self, replication_jump: Optional[int] = None, replication_factor: int = 2):
        super().__init__()
        self.replication_jump = replication_jump
        self.replication_factor = replication_factor

    def _eager_build(self) -> CliqueReplicationStrategy:
        return CliqueReplicationStrategy.from_replication_params(
            self.replication_jump, self.replication_factor
        )
