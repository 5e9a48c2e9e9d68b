"""Replicate one rank's local checkpoint part to its clique peers while it is written,
and keep theirs (background writer).

:class:`PartReplication` is told where by the save's
:class:`~megatron_async.local.exchange.PeerExchange`; it runs in the **background
writer** (a forked child or the persistent worker), never on the training thread, and
without ``torch.distributed`` process groups, which a forked writer cannot use. For one
save, it:

1. listens on an ephemeral port and publishes ``ip:port`` under ``<key_prefix>/<rank>``
   through its own client of the job's store, and connects to every peer on threads: it
   waits for the peer's address (an address an earlier attempt left, refused, is read
   again until the deadline), connects and sends a header (session, iteration, owner,
   receiver, identity);
2. while the part is written, is handed every chunk of it
   (:meth:`PartReplication.send`, from the part's bounce chunk, hashed there, before it
   goes to the disk) and sends it to every connected peer as one frame: the part is
   never read back. The first chunk waits for the connections; the end of the part
   (:meth:`PartReplication.end`) sends its size and digest, before this rank's own
   fsync, so that both sides make their copies durable at once;
3. receives every peer's part on threads (:mod:`.replica_receiver`), written as a
   replica as it arrives and acknowledged only once it is durable and hashed to the
   digest its owner sent last; otherwise it answers with the reason.

A writer whose own part failed tells its connected peers so in place of the digest, and
publishes the reason under its key (:func:`~megatron_async.local.transport.publish_failure`),
as does one that cannot listen or publish its address: its peers fail at once.
Every wait is bounded: connecting by the exchange's timeout from its start, each frame
sent or received by the timeout, and the end (acknowledgements, the peers' parts) by the
timeout from the end of this rank's part. The listener, connections and threads are
closed and the store key deleted on every path.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from megatron_async.errors import LocalCheckpointError, LocalReplicationError
from megatron_async.local import transport
from megatron_async.local.exchange import PeerExchange
from megatron_async.local.parts import LocalIdentity, PartRecord
from megatron_async.local.replica_receiver import ReplicaReceiver

__all__ = ["PartReplication"]

logger = logging.getLogger(__name__)

_CLOSE_GRACE_S = 2.0


class PartReplication:
    """One run of a part's replication (background writer): a context manager around the
    part's write, whose chunks it is handed (:meth:`send`, :meth:`end`), then
    :meth:`finish`; the sending side is here, the receiving side a :class:`ReplicaReceiver`.

    Each peer is settled once per direction: ``sent[peer]`` is None when it acknowledged
    this rank's part, ``received[peer]`` the record of its durable replica; a string in
    either says what failed. The first outcome counts, later ones are echoes of the
    closing.

    Args:
        spec: where the part goes and the bound of each wait.
        owner: this rank (the part's owner).
        iteration: the part's iteration.
        identity: the job's identity, sent with the part and checked on the peers' parts.

    Raises:
        LocalReplicationError: (entering) the writer cannot listen or publish its address.
    """

    def __init__(self, spec: PeerExchange, owner: int, iteration: int, identity: LocalIdentity):
        if owner in spec.peers:
            raise LocalCheckpointError(f"rank {owner} is among its own peers {spec.peers}")
        self.spec, self.rank, self.iteration, self.identity = spec, owner, iteration, identity
        self.deadline = time.monotonic() + spec.timeout_s  # connecting; end() sets it again
        self.cond = threading.Condition()
        self.sent: Dict[int, Optional[str]] = {}
        self.received: Dict[int, Any] = {}
        self.receiving: set = set()
        self.links: Dict[int, socket.socket] = {}  # peers this rank's part streams to
        self.phase = dict.fromkeys(spec.peers, "address")  # what each send waits for
        self.address: Dict[int, str] = {}  # the address last tried, and why it failed
        self.sockets: List[socket.socket] = []
        self.threads: List[threading.Thread] = []
        self.closed = False
        self.store: Optional[dist.TCPStore] = None
        self.published = False  # this rank's address is under its key, to delete at close
        self.listener: Optional[socket.socket] = None
        self.store_lock = threading.Lock()

    # -- the writer's side ----------------------------------------------------------------

    def __enter__(self) -> "PartReplication":
        spec = self.spec
        try:
            self.store = transport.store_client(spec.store_host, spec.store_port, spec.timeout_s)
            advertised = transport.advertised_address(spec.store_host, spec.store_port)
            self.listener = transport.listen(advertised, len(spec.peers) + 4)
            self.store.set(spec.key(self.rank), f"{advertised}:{self.listener.getsockname()[1]}")
            self.published = True
        except Exception as exc:
            reason = f"cannot listen for its peers or publish its address: {exc}"
            self.fail(reason)
            self.close()
            raise LocalReplicationError(
                f"rank {self.rank}: {reason} (the job's store at "
                f"{spec.store_host}:{spec.store_port})"
            ) from exc
        self.start(ReplicaReceiver(self).accept_loop, self.listener)
        for peer in spec.peers:
            self.start(self.connect, peer)
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def send(self, chunk: memoryview) -> None:
        """Send the part's next bytes to every peer still streaming (the writer's thread,
        before the bytes go to the disk). The first call waits for the connections; a
        peer whose connection breaks is dropped (its outcome says why); never raises."""
        for peer in self.spec.peers:
            sock = self.link(peer)
            if sock is None:
                continue
            try:
                sock.settimeout(self.spec.timeout_s)
                transport.send_frame(sock, chunk)
            except OSError as exc:
                self.drop(peer, sock, f"the connection broke while sending rank {self.rank}'s "
                                      f"part ({exc})")

    def end(self, num_bytes: int, digest: str) -> None:
        """The part is complete (before this rank's fsync): send its size and digest to
        every peer streaming, which then acknowledges it once its replica is durable.
        From now on every wait of the run ends ``timeout_s`` later."""
        with self.cond:
            self.deadline = time.monotonic() + self.spec.timeout_s
        self.close_links({"num_bytes": num_bytes, "digest": digest})

    def fail(self, reason: str) -> None:
        """This rank's part failed (the writer's thread): tell the peers, streaming or
        still to connect, so that none waits for it."""
        spec = self.spec
        self.published = False  # the failure stays published until the save is abandoned
        transport.publish_failure(spec.store_host, spec.store_port, spec.key(self.rank), reason)
        self.close_links({"error": reason})

    def finish(self) -> List[PartRecord]:
        """Wait until every peer is settled both ways, or the deadline; close the run.

        Returns:
            The records of the replicas written into ``spec.directory``, by owner.

        Raises:
            LocalReplicationError: some peer's part was not kept, or some peer did not
                acknowledge this rank's part (``failures`` says per peer).
        """
        peers = self.spec.peers
        with self.cond:
            self.cond.wait_for(
                lambda: len(self.sent) == len(self.received) == len(peers),
                timeout=max(self.remaining(), 0),
            )
        self.close()
        failures: Dict[int, List[str]] = {}
        for peer in peers:
            for outcome in (self.sent[peer], self.received[peer]):
                if isinstance(outcome, str):
                    failures.setdefault(peer, []).append(outcome)
        if failures:
            text = "; ".join(f"rank {p}: {what}" for p, whats in failures.items() for what in whats)
            raise LocalReplicationError(
                f"rank {self.rank}: local checkpoint of iteration {self.iteration} was "
                f"not replicated: {text}", failures,
            )
        return [self.received[peer] for peer in sorted(peers)]

    # -- the run's threads ----------------------------------------------------------------

    def connect(self, peer: int) -> None:
        """Connect to ``peer`` and send the header (a thread per peer)."""
        def note(address: Optional[str]) -> None:
            self.phase[peer] = "address" if address is None else "connection"
            if address is not None:
                self.address[peer] = address

        try:
            sock, failed = transport.connect_published(
                self.store, self.spec.key(peer), self.deadline, self.store_lock, note,
                lambda: self.closed or peer in self.sent,
            )
            if failed is not None:
                failed = f"its own part failed ({failed})"
                self.settle(self.received, peer, failed)
                self.settle(self.sent, peer, failed)
                return
            if sock is None:
                self.settle(self.sent, peer, self.timed_out(peer))
                return
            if not self.register(sock):
                return
            self.phase[peer] = "transfer"
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.wait_s())
            header = dict(
                session_id=self.spec.session_id, iteration=self.iteration, owner=self.rank,
                receiver=peer, identity=dataclasses.asdict(self.identity),
            )
            transport.send_message(sock, header)
        except Exception as exc:
            self.settle(self.sent, peer, f"connecting to it failed: {type(exc).__name__}: {exc}")
            return
        with self.cond:
            if peer not in self.sent:
                self.links[peer] = sock
                self.cond.notify_all()

    def link(self, peer: int) -> Optional[socket.socket]:
        """``peer``'s connection once made; None when it failed or the deadline passed."""
        with self.cond:
            self.cond.wait_for(
                lambda: peer in self.links or peer in self.sent or self.closed,
                timeout=max(self.remaining(), 0),
            )
            if peer not in self.links and peer not in self.sent:
                self.sent[peer] = self.timed_out(peer)
                self.cond.notify_all()
            return self.links.get(peer)

    def drop(self, peer: int, sock: socket.socket, broken: Optional[str]) -> None:
        """Stop streaming to ``peer``; its answer (or ``broken``) settles the send."""
        with self.cond:
            self.links.pop(peer, None)
        self.start(self.await_answer, peer, sock, broken)

    def close_links(self, trailer: Dict[str, Any]) -> None:
        """End every stream with ``trailer`` (the digest, or why the part failed)."""
        with self.cond:
            links = list(self.links.items())
        for peer, sock in links:
            try:
                sock.settimeout(self.spec.timeout_s)
                transport.send_frame(sock, b"")
                transport.send_message(sock, trailer)
                sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                self.drop(peer, sock, f"the connection broke while sending rank {self.rank}'s "
                                      f"part ({exc})")
                continue
            self.phase[peer] = "ack"
            self.drop(peer, sock, None)

    def await_answer(self, peer: int, sock: socket.socket, broken: Optional[str]) -> None:
        """Settle the send to ``peer`` from its answer (a thread per peer)."""
        try:
            sock.settimeout(self.wait_s() if broken is None else min(self.wait_s(), 1.0))
            reply = transport.recv_message(sock)
        except (transport.PeerLost, ValueError) as exc:
            if self.remaining() <= 0:
                outcome = self.timed_out(peer)
            else:
                if isinstance(exc, transport.PeerLost):
                    self.went_away(peer, exc)
                outcome = broken or f"no acknowledgement of rank {self.rank}'s part ({exc})"
        else:
            if reply.get("ok") is True:
                outcome = broken
            else:
                outcome = f"it refused rank {self.rank}'s part: {reply.get('error')}"
        self.settle(self.sent, peer, outcome)

    def went_away(self, peer: int, exc: Exception) -> None:
        """``peer`` closed unanswered (its writer died or ended its exchange): unless its
        part is arriving, stop waiting for it."""
        with self.cond:
            arriving = peer in self.receiving
        if not arriving:
            self.settle(self.received, peer, f"it went away before sending its part ({exc})")

    # -- the run's state ------------------------------------------------------------------

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def wait_s(self) -> float:
        """A socket timeout that ends at the deadline."""
        return max(self.remaining(), 1e-3)

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

    def close(self) -> None:
        """Settle what is open as timed out, shut every socket down, join the threads,
        then close the sockets (left open, logged, while a thread that did not stop may
        still use one) and delete the published address (idempotent)."""
        waited = f"timed out after {self.spec.timeout_s:g} s"
        with self.cond:
            if self.closed:
                return
            for peer in self.spec.peers:
                self.sent.setdefault(peer, self.timed_out(peer))
                self.received.setdefault(
                    peer, f"{waited} while its part was arriving" if peer in self.receiving
                    else f"it did not send its part within {self.spec.timeout_s:g} s",
                )
            self.closed = True
            self.cond.notify_all()
            listener = [self.listener] if self.listener is not None else []
            sockets, threads = self.sockets + listener, self.threads
        for sock in sockets:
            transport.shutdown_socket(sock)
        stop_by = time.monotonic() + _CLOSE_GRACE_S
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
        if self.published:
            try:
                with self.store_lock:  # the same client, with a short bound
                    store = transport.store_client(
                        self.spec.store_host, self.spec.store_port, _CLOSE_GRACE_S
                    )
                    store.delete_key(self.spec.key(self.rank))
            except Exception as exc:  # best effort: the next attempt overwrites it
                logger.warning("rank %d: cannot delete its store key: %s", self.rank, exc)

    def timed_out(self, peer: int) -> str:
        """What the send to ``peer`` was waiting for when the deadline passed."""
        return f"timed out after {self.spec.timeout_s:g} s " + {
            "address": f"waiting for it to publish its address under '{self.spec.key(peer)}' "
            "(did it die, or not start this save?)",
            "connection": f"connecting to it at {self.address.get(peer)}",
            "transfer": f"sending rank {self.rank}'s part to it",
            "ack": f"waiting for it to acknowledge rank {self.rank}'s part",
        }[self.phase[peer]]
