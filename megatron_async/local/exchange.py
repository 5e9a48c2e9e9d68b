"""Where one local save's part is replicated, and the store key it leaves (training process).

:class:`PeerExchange` is built by the manager's ``save`` on every rank (the store's
address comes from :func:`~megatron_async.local.transport.store_address`) and travels
in the save's request to the background writer, whose
:class:`~megatron_async.local.part_replication.PartReplication` it drives.
:class:`ForgetPublishedKey` is a finalize step of the save, on the training thread.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

from megatron_async.errors import LocalCheckpointError
from megatron_async.local import transport

__all__ = ["PeerExchange", "ForgetPublishedKey"]

_FORGET_BOUND_S = 2.0
"""Bound on deleting a failed save's key from the store (best effort)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerExchange:
    """Where one local save's part goes (built in the training process, used by the writer).

    It pickles: it travels in the save's request to the persistent worker.
    """

    store_host: str
    """The job's TCPStore host, from :func:`~megatron_async.local.transport.store_address`."""
    store_port: int
    """Its port."""
    key_prefix: str
    """Names this save in the store (its session and iteration); every rank of the save
    passes the same one, and no other save of the job uses it."""
    session_id: str
    """The manager's session, checked in every received header."""
    peers: Tuple[int, ...]
    """The other global ranks of this rank's clique (``CliqueReplicationStrategy.peers``)."""
    directory: str
    """This rank's holder directory: received replicas are written there."""
    timeout_s: float
    """Bound on each wait of the exchange: connecting (from its start), each frame, and
    its end (from the end of this rank's part)."""

    def key(self, rank: int) -> str:
        """The store key under which ``rank`` publishes its address for this save."""
        return f"{self.key_prefix}/{rank}"

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise LocalCheckpointError(f"the exchange needs timeout_s > 0, not {self.timeout_s!r}")
        if len(set(self.peers)) != len(self.peers):
            raise LocalCheckpointError(f"peers must be distinct ranks, not {self.peers}")


class ForgetPublishedKey:
    """A finalize step of a replicated local save: when the save failed (``abandon``),
    delete this rank's key of the save from the job's store (every rank, trainer).

    The queue abandons a save only after every rank's writer ended, so no peer reads the
    key any more. A failure the writer published
    (:func:`~megatron_async.local.transport.publish_failure`) must stay until then for
    its peers to stop waiting: without this step every failed save would leave one key
    per failed rank in the store for the rest of the job. A save that finalized left no
    key (its writer deleted the address it published), so finalizing costs the training
    thread no store round trip.
    """

    def __init__(self, exchange: PeerExchange, rank: int):
        self._exchange = exchange
        self._rank = rank

    def __call__(self) -> None:
        """The save finalized: nothing to delete."""

    def abandon(self) -> None:
        spec = self._exchange
        transport.forget_key(spec.store_host, spec.store_port, spec.key(self._rank), _FORGET_BOUND_S)
