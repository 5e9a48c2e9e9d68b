"""Replicate one rank's local checkpoint part to its clique peers, and keep theirs.

:class:`PeerExchange` is built in the training process (the store's address comes from
:func:`~megatron_async.local.transport.store_address`) and travels in the save's
request. :func:`exchange_part` runs in the **background writer** (a forked child or the
persistent worker), never on the training thread, and without ``torch.distributed``
process groups, which a forked writer cannot use. For one save, it:

1. listens on an ephemeral port and publishes ``ip:port`` under ``<key_prefix>/<rank>``
   through its own client of the job's store;
2. sends this rank's part to every peer: it waits for the peer's address, connects
   (an address an earlier attempt left, refused, is read again until the deadline),
   sends a header (session, iteration, owner, receiver, size, digest, identity) and the
   bytes, and waits for the peer's acknowledgement;
3. receives every peer's part on threads (:mod:`.replica_receiver`), written as a
   replica and acknowledged only once it is durable and hashed to the owner's digest;
   otherwise it answers with the reason.

A writer whose own part failed, or that cannot listen or publish its address, publishes
the reason under its key instead of an address
(:func:`~megatron_async.local.transport.publish_failure`): its peers fail at once.

The part is sent from its written file with ``socket.sendfile``, so it never passes
through the writer's memory; the receiver's digest check covers the transfer.
Every wait ends at the caller's deadline; the listener, connections and threads are
closed and the store key deleted on every path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron_async.errors import LocalCheckpointError, LocalReplicationError
from megatron_async.local import transport
from megatron_async.local.parts import PartRecord
from megatron_async.local.replica_receiver import ReplicaReceiver

__all__ = ["PeerExchange", "ForgetPublishedKey", "exchange_part"]

logger = logging.getLogger(__name__)

_CLOSE_GRACE_S = 2.0


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
    """Bound on the whole exchange, every wait included."""

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
        transport.forget_key(spec.store_host, spec.store_port, spec.key(self._rank), _CLOSE_GRACE_S)


def exchange_part(exchange: PeerExchange, record: PartRecord, path: str) -> List[PartRecord]:
    """Send this rank's part to every peer and keep every peer's part (background writer).

    Each peer's copy goes from the part's file with ``sendfile``: the kernel reads it and
    hands it to the socket, with no copy through this process's memory and no mapping of
    the file (a part written with direct I/O is read back from the disk either way).

    Args:
        exchange: where the part goes and the deadline.
        record: the part's record as :func:`~megatron_async.local.part_output.open_part`
            computed it; its owner is this rank.
        path: the part's file.

    Returns:
        The records of the replicas written into ``exchange.directory``, by owner.

    Raises:
        LocalReplicationError: some peer's part was not kept, or some peer did not
            acknowledge this rank's part, by the deadline (``failures`` says per peer); or
            the writer could not listen or publish its address.
        LocalCheckpointError: the file is not of the record's size, or no address of this
            node is found (set ``MEGATRON_ASYNC_LOCAL_ADDR``).
    """
    if not exchange.peers:
        return []
    if record.owner in exchange.peers:
        raise LocalCheckpointError(f"rank {record.owner} is among its own peers {exchange.peers}")
    size = os.path.getsize(path)
    if size != record.num_bytes:
        raise LocalCheckpointError(
            f"rank {record.owner}'s part {path} holds {size} bytes, its record says "
            f"{record.num_bytes}"
        )
    return _Exchange(exchange, record, path).run()


class _Exchange:
    """One run of :func:`exchange_part`: its listener, threads and per-peer outcomes; the
    sending side is here, the receiving side is a :class:`ReplicaReceiver` of the run.

    Each peer is settled once per direction: ``sent[peer]`` is None when it acknowledged
    this rank's part, ``received[peer]`` the record of its durable replica; a string in
    either says what failed. The run ends when every peer is settled both ways or the
    deadline passes; the first outcome counts, later ones are echoes of the closing.
    """

    def __init__(self, spec: PeerExchange, record: PartRecord, path: str):
        self.spec, self.record, self.path, self.rank = spec, record, path, record.owner
        self.deadline = time.monotonic() + spec.timeout_s
        self.cond = threading.Condition()
        self.sent: Dict[int, Optional[str]] = {}
        self.received: Dict[int, Any] = {}
        self.receiving: set = set()
        self.phase = dict.fromkeys(spec.peers, "address")  # what each send waits for
        self.address: Dict[int, str] = {}  # the address last tried, and why it failed
        self.sockets: List[socket.socket] = []
        self.threads: List[threading.Thread] = []
        self.closed = False
        self.store_lock = threading.Lock()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self) -> List[PartRecord]:
        """Publish, send and receive until every peer is settled or the deadline passes."""
        spec, store, listener = self.spec, None, None
        try:
            try:
                store = transport.store_client(spec.store_host, spec.store_port, spec.timeout_s)
                advertised = transport.advertised_address(spec.store_host, spec.store_port)
                listener = transport.listen(advertised, len(spec.peers) + 4)
                store.set(self.spec.key(self.rank), f"{advertised}:{listener.getsockname()[1]}")
            except Exception as exc:
                reason = f"cannot listen for its peers or publish its address: {exc}"
                transport.publish_failure(
                    spec.store_host, spec.store_port, self.spec.key(self.rank), reason
                )
                store = None  # the failure stays published for the peers
                raise LocalReplicationError(
                    f"rank {self.rank}: {reason} (the job's store at "
                    f"{spec.store_host}:{spec.store_port})"
                ) from exc
            self.start(ReplicaReceiver(self).accept_loop, listener)
            for peer in spec.peers:
                self.start(self.send_loop, store, peer)

            def settled() -> bool:
                return len(self.sent) == len(self.received) == len(spec.peers)

            with self.cond:
                self.cond.wait_for(settled, timeout=max(self.remaining(), 0))
        finally:
            self.close(listener)
            if store is not None:
                try:
                    with self.store_lock:  # the same client, with a short bound
                        store = transport.store_client(
                            spec.store_host, spec.store_port, _CLOSE_GRACE_S
                        )
                        store.delete_key(self.spec.key(self.rank))
                except Exception as exc:  # best effort: the next attempt overwrites it
                    logger.warning("rank %d: cannot delete its store key: %s", self.rank, exc)
        failures: Dict[int, List[str]] = {}
        for peer in spec.peers:
            for outcome in (self.sent[peer], self.received[peer]):
                if isinstance(outcome, str):
                    failures.setdefault(peer, []).append(outcome)
        if failures:
            text = "; ".join(f"rank {p}: {what}" for p, whats in failures.items() for what in whats)
            raise LocalReplicationError(
                f"rank {self.rank}: local checkpoint of iteration {self.record.iteration} was "
                f"not replicated: {text}", failures,
            )
        return [self.received[peer] for peer in sorted(spec.peers)]

    def settle(self, outcomes: Dict[int, Any], peer: int, outcome: Any) -> None:
        with self.cond:  # None: a stranger's connection, nobody's outcome
            if not self.closed and peer is not None and peer not in outcomes:
                outcomes[peer] = outcome
                self.cond.notify_all()

    def start(self, target, *args) -> None:
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

    def close(self, listener: Optional[socket.socket]) -> None:
        """Settle what is open as timed out, shut every socket down, join the threads,
        then close the sockets (left open, logged, while a thread that did not stop may
        still use one)."""
        waited = f"timed out after {self.spec.timeout_s:g} s"
        with self.cond:
            for peer in self.spec.peers:
                self.sent.setdefault(peer, self.timed_out(peer))
                self.received.setdefault(
                    peer, f"{waited} while its part was arriving" if peer in self.receiving
                    else f"it did not send its part within {self.spec.timeout_s:g} s",
                )
            self.closed = True
            sockets, threads = self.sockets + [listener] * (listener is not None), self.threads
        for sock in sockets:
            transport.shutdown_socket(sock)
        stop_by = time.monotonic() + _CLOSE_GRACE_S
        stuck = []
        for thread in threads:
            thread.join(max(stop_by - time.monotonic(), 0))
            if thread.is_alive():
                stuck.append(thread.name)
        if stuck:
            logger.warning("rank %d: exchange threads %s did not stop; their sockets stay open",
                           self.rank, ", ".join(stuck))
            return
        for sock in sockets:
            sock.close()

    def timed_out(self, peer: int) -> str:
        """What the send to ``peer`` was waiting for when the deadline passed."""
        return f"timed out after {self.spec.timeout_s:g} s " + {
            "address": f"waiting for it to publish its address under '{self.spec.key(peer)}' "
            "(did it die, or not start this save?)",
            "connection": f"connecting to it at {self.address.get(peer)}",
            "transfer": f"sending rank {self.rank}'s part to it",
            "ack": f"waiting for it to acknowledge rank {self.rank}'s part",
        }[self.phase[peer]]

    def send_loop(self, store: dist.TCPStore, peer: int) -> None:
        """Settle the send to ``peer`` (a thread per peer)."""
        try:
            self.settle(self.sent, peer, self.send(store, peer))
        except Exception as exc:
            self.settle(self.sent, peer, f"sending to it failed: {type(exc).__name__}: {exc}")

    def send(self, store: dist.TCPStore, peer: int) -> Optional[str]:
        """Send the part to ``peer``; None when it acknowledged, else what went wrong."""
        def note(address: Optional[str]) -> None:
            self.phase[peer] = "address" if address is None else "connection"
            if address is not None:
                self.address[peer] = address

        sock, failed = transport.connect_published(
            store, self.spec.key(peer), self.deadline, self.store_lock, note, lambda: self.closed
        )
        if failed is not None:
            failed = f"its own part failed ({failed})"
            self.settle(self.received, peer, failed)
            return failed
        if sock is None:
            return self.timed_out(peer)
        if not self.register(sock):
            return None
        self.phase[peer] = "transfer"
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header = dataclasses.asdict(self.record)
            header.update(session_id=self.spec.session_id, receiver=peer)
            sock.settimeout(self.wait_s())
            transport.send_message(sock, header)
            with open(self.path, "rb") as part:  # its own file position per peer
                sock.settimeout(self.wait_s())  # bounds each wait; close() ends it at the deadline
                sock.sendfile(part)
            sock.shutdown(socket.SHUT_WR)
            self.phase[peer] = "ack"
        except OSError as exc:  # it may have refused the part and said why
            broken = f"the connection broke while sending rank {self.rank}'s part ({exc})"
        else:
            broken = None
        try:
            sock.settimeout(self.wait_s() if broken is None else min(self.wait_s(), 1.0))
            reply = transport.recv_message(sock)
        except (transport.PeerLost, ValueError) as exc:
            if self.remaining() <= 0:
                return self.timed_out(peer)
            if isinstance(exc, transport.PeerLost):
                self.went_away(peer, exc)
            return broken or f"no acknowledgement of rank {self.rank}'s part ({exc})"
        if reply.get("ok") is True:
            return broken
        return f"it refused rank {self.rank}'s part: {reply.get('error')}"

    def went_away(self, peer: int, exc: Exception) -> None:
        """``peer`` closed unanswered (its writer died or ended its exchange): unless its
        part is arriving, stop waiting for it."""
        with self.cond:
            arriving = peer in self.receiving
        if not arriving:
            self.settle(self.received, peer, f"it went away before sending its part ({exc})")

    def wait_s(self) -> float:
        """A socket timeout that ends at the deadline."""
        return max(self.remaining(), 1e-3)
