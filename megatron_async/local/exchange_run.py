"""The state one replication run shares between its threads (background writer).

A :class:`~megatron_async.local.part_replication.PartReplication` sends this rank's part
to its peers and receives theirs, on threads of its own (one accepts the peers'
connections, one receives each peer's part, one connects to each peer, one waits for
each peer's answer). :class:`ExchangeRun` is what they share, under one condition: the
outcome per peer and direction, the threads and sockets to end with the run, and how the
run closes. The receiving threads (:mod:`.replica_receiver`) see only this.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Dict, List, Optional

from megatron_async.local import transport
from megatron_async.local.exchange import PeerExchange
from megatron_async.local.parts import LocalIdentity

__all__ = ["ExchangeRun"]

logger = logging.getLogger(__name__)

CLOSE_GRACE_S = 2.0
"""The bound of each step of closing: the run's threads stopping once their sockets are
shut, and (:class:`~megatron_async.local.part_replication.PartReplication`) taking the
store client and deleting the published address."""


class ExchangeRun:
    """The shared state of one replication run (background writer, the run's threads).

    Each peer is settled once per direction: ``sent[peer]`` is None when it acknowledged
    this rank's part, ``received[peer]`` the record of its durable replica; a string in
    either says what failed. The first outcome counts: later ones are echoes of the
    closing. ``receiving`` holds the owners whose part is arriving.

    Args:
        spec: where the part goes, the peers and the bound of each wait.
        rank: this rank (the owner of the part sent).
        iteration: the save's iteration.
        identity: the job's identity, sent with the part and checked on the peers' parts.
    """

    def __init__(self, spec: PeerExchange, rank: int, iteration: int, identity: LocalIdentity):
        self.spec, self.rank, self.iteration, self.identity = spec, rank, iteration, identity
        self.cond = threading.Condition()
        self.sent: Dict[int, Optional[str]] = {}
        self.received: Dict[int, Any] = {}
        self.receiving: set = set()
        self.sockets: List[socket.socket] = []
        self.threads: List[threading.Thread] = []
        self.closed = False

    def settle(self, outcomes: Dict[int, Any], peer: Optional[int], outcome: Any) -> None:
        """Record ``peer``'s outcome in ``outcomes`` (``sent`` or ``received``) unless one
        is there or the run closed; None as the peer (a stranger's connection) is ignored."""
        with self.cond:
            if not self.closed and peer is not None and peer not in outcomes:
                outcomes[peer] = outcome
                self.cond.notify_all()

    def stop_waiting_for(self, peer: int, why: str) -> None:
        """Settle ``peer``'s part as not coming, unless it is arriving."""
        with self.cond:
            if peer not in self.receiving:
                self.settle(self.received, peer, why)

    def all_settled(self) -> bool:
        """Whether every peer is settled both ways (call under ``cond``)."""
        peers = len(self.spec.peers)
        return len(self.sent) == len(self.received) == peers

    def start(self, target, *args) -> None:
        """Run ``target(*args)`` on a thread of the run."""
        name = f"local-exchange-{target.__name__}"
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self.cond:
            self.threads.append(thread)
        thread.start()

    def register(self, sock: socket.socket) -> bool:
        """Keep ``sock`` to close with the run; False (and closed) if the run is over."""
        with self.cond:
            if not self.closed:
                self.sockets.append(sock)
                return True
        transport.close_socket(sock)
        return False

    def close_run(self, unsent: Dict[int, str], extra: List[socket.socket]) -> bool:
        """Settle what is open (the sends as ``unsent`` says, the parts as not received),
        shut every socket down, join the threads, then close the sockets (left open,
        logged, while a thread that did not stop may still use one). False when the run
        was closed already."""
        waited = f"timed out after {self.spec.timeout_s:g} s"
        with self.cond:
            if self.closed:
                return False
            for peer in self.spec.peers:
                self.sent.setdefault(peer, unsent[peer])
                self.received.setdefault(
                    peer, f"{waited} while its part was arriving" if peer in self.receiving
                    else f"it did not send its part within {self.spec.timeout_s:g} s",
                )
            self.closed = True
            self.cond.notify_all()
            sockets, threads = self.sockets + extra, self.threads
        for sock in sockets:
            transport.shutdown_socket(sock)
        stop_by = time.monotonic() + CLOSE_GRACE_S
        stuck = []
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(stop_by - time.monotonic(), 0))
                if thread.is_alive():
                    stuck.append(thread.name)
        if stuck:
            logger.warning("rank %d: exchange threads %s did not stop; their sockets stay open",
                           self.rank, ", ".join(stuck))
        else:
            for sock in sockets:
                sock.close()
        return True
