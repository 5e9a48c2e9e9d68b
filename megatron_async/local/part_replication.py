"""Replicate one rank's local checkpoint part to its clique peers while it is written,
and keep theirs (background writer).

:class:`PartReplication` is told where by the save's
:class:`~megatron_async.local.exchange.PeerExchange`; it runs in the **background
writer** (a forked child or the persistent worker), never on the training thread, and
without ``torch.distributed`` process groups, which a forked writer cannot use. For one
save, it:

1. listens on an ephemeral port and publishes ``ip:port`` under ``<key_prefix>/<rank>``
   through its own client of the job's store, and connects to every peer on threads: it
   waits for the peer's address, connects and sends a header (session, iteration, owner,
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

A writer whose own part failed before its end tells its streaming peers so in place of
the digest, and publishes the reason under its key
(:func:`~megatron_async.local.transport.publish_failure`), as does one that cannot listen
or publish its address: its peers fail at once. (One whose fsync fails after its end
leaves its peers with acknowledged replicas; the save fails at finalize all the same,
and the abandoned iteration's files go.) A peer whose address refuses has ended its
exchange: it fails at once too. Every wait is bounded: connecting by the exchange's
timeout from its start, each frame sent or received by the timeout, and the end
(acknowledgements, the peers' parts) by the timeout from the end of this rank's part. The
listener, connections and threads are closed and the store key deleted on every path.
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
from megatron_async.local.exchange_run import CLOSE_GRACE_S, ExchangeRun
from megatron_async.local.parts import LocalIdentity, PartRecord
from megatron_async.local.replica_receiver import ReplicaReceiver

__all__ = ["PartReplication"]

logger = logging.getLogger(__name__)

_BROKEN_ANSWER_S = 1.0
"""How long a peer whose stream broke is given to say why (it may have refused the part)."""


class PartReplication(ExchangeRun):
    """One run of a part's replication (background writer): a context manager around the
    part's write, whose chunks it is handed (:meth:`send`, :meth:`end`), then
    :meth:`finish`. The sending side is here, the receiving side a
    :class:`ReplicaReceiver` of the run; the state they share is :class:`ExchangeRun`'s.

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
        super().__init__(spec, owner, iteration, identity)
        self.connect_by = time.monotonic() + spec.timeout_s
        self.end_by: Optional[float] = None  # set by end(): acks and the peers' parts
        self.links: Dict[int, socket.socket] = {}  # peers this rank's part streams to
        self.ended: set = set()  # peers whose stream is over (ended, broken or dropped)
        self.trailer: Optional[Dict[str, Any]] = None  # what ended the streams
        self.phase = dict.fromkeys(spec.peers, "address")  # what each send waits for
        self.address: Dict[int, str] = {}  # the address last tried
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
                with self.cond:
                    self.links.pop(peer, None)
                    self.ended.add(peer)
                self.start(self.await_answer, peer, sock, self.broke(exc))

    def end(self, num_bytes: int, digest: str) -> None:
        """The part is complete (before this rank's fsync): send its size and digest to
        every peer streaming, which then acknowledges it once its replica is durable.
        The acknowledgements and the peers' parts are waited for ``timeout_s`` from now."""
        self.end_by = time.monotonic() + self.spec.timeout_s
        self.end_streams({"num_bytes": num_bytes, "digest": digest})

    def fail(self, reason: str) -> None:
        """This rank's part failed (the writer's thread): tell the peers, streaming or
        still to connect, so that none waits for it."""
        spec = self.spec
        self.published = False  # the failure stays published until the save is abandoned
        locked = self.store_lock.acquire(timeout=CLOSE_GRACE_S)  # the connect threads' client
        try:
            transport.publish_failure(spec.store_host, spec.store_port, spec.key(self.rank),
                                      reason, CLOSE_GRACE_S)
        finally:
            if locked:
                self.store_lock.release()
        self.end_streams({"error": reason})

    def finish(self) -> List[PartRecord]:
        """Wait until every peer is settled both ways, or the end's bound; close the run.

        Returns:
            The records of the replicas written into ``spec.directory``, by owner.

        Raises:
            LocalReplicationError: some peer's part was not kept, or some peer did not
                acknowledge this rank's part (``failures`` says per peer).
        """
        end_by = self.end_by if self.end_by is not None else time.monotonic()  # no part sent
        with self.cond:
            self.cond.wait_for(self.all_settled, timeout=max(end_by - time.monotonic(), 0))
        self.close()
        failures: Dict[int, List[str]] = {}
        for peer in self.spec.peers:
            for outcome in (self.sent[peer], self.received[peer]):
                if isinstance(outcome, str):
                    failures.setdefault(peer, []).append(outcome)
        if failures:
            text = "; ".join(f"rank {p}: {what}" for p, whats in failures.items() for what in whats)
            raise LocalReplicationError(
                f"rank {self.rank}: local checkpoint of iteration {self.iteration} was "
                f"not replicated: {text}", failures,
            )
        return [self.received[peer] for peer in sorted(self.spec.peers)]

    # -- the run's threads ----------------------------------------------------------------

    def connect(self, peer: int) -> None:
        """Connect to ``peer`` and send the header (a thread per peer)."""
        def note(address: Optional[str]) -> None:
            self.phase[peer] = "address" if address is None else "connection"
            if address is not None:
                self.address[peer] = address

        try:
            sock, why = transport.connect_published(
                self.store, self.spec.key(peer), self.connect_by, self.store_lock, note,
                lambda: self.closed or peer in self.sent,
            )
            if sock is None:
                self.settle(self.sent, peer, why or self.timed_out(peer))
                self.stop_waiting_for(peer, why or f"it did not connect within "
                                                   f"{self.spec.timeout_s:g} s")
                return
            if not self.register(sock):
                return
            self.phase[peer] = "transfer"
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(self.connect_by - time.monotonic(), 1e-3))
            header = dict(
                session_id=self.spec.session_id, iteration=self.iteration, owner=self.rank,
                receiver=peer, identity=dataclasses.asdict(self.identity),
            )
            transport.send_message(sock, header)
        except Exception as exc:
            why = f"connecting to it failed: {type(exc).__name__}: {exc}"
            self.settle(self.sent, peer, why)
            self.stop_waiting_for(peer, why)
            return
        with self.cond:
            trailer = self.trailer
            if trailer is None and peer not in self.sent:
                self.links[peer] = sock
                self.cond.notify_all()
                return
            self.ended.add(peer)
        if trailer is not None and "error" in trailer:  # it failed while this one connected
            self.end_stream(peer, sock, trailer)
            return
        # The part ended before this connection (or the send gave up on it): nothing to send.
        self.settle(self.sent, peer, f"it connected after rank {self.rank}'s part was sent")
        transport.shutdown_socket(sock)

    def link(self, peer: int) -> Optional[socket.socket]:
        """``peer``'s connection once made; None when its stream is over, it failed, or
        it did not connect within the bound (then both its directions are settled so)."""
        with self.cond:
            self.cond.wait_for(
                lambda: peer in self.links or peer in self.ended or peer in self.sent
                or self.closed,
                timeout=max(self.connect_by - time.monotonic(), 0),
            )
            sock = self.links.get(peer)
            gave_up = sock is None and peer not in self.ended and peer not in self.sent
            if gave_up:
                self.settle(self.sent, peer, self.timed_out(peer))
                self.stop_waiting_for(peer, f"it did not connect within {self.spec.timeout_s:g} s")
        return sock

    def end_streams(self, trailer: Dict[str, Any]) -> None:
        """End every stream with ``trailer`` (the digest, or why the part failed); a peer
        that connects later gets a failure's trailer too."""
        with self.cond:
            self.trailer = trailer
            links = list(self.links.items())
            self.links.clear()
            self.ended.update(peer for peer, _ in links)
        for peer, sock in links:
            self.end_stream(peer, sock, trailer)

    def end_stream(self, peer: int, sock: socket.socket, trailer: Dict[str, Any]) -> None:
        try:
            sock.settimeout(self.spec.timeout_s)
            transport.send_frame(sock, b"")
            transport.send_message(sock, trailer)
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            self.start(self.await_answer, peer, sock, self.broke(exc))
            return
        self.phase[peer] = "ack"
        self.start(self.await_answer, peer, sock, None)

    def broke(self, exc: OSError) -> str:
        return f"the connection broke while sending rank {self.rank}'s part ({exc})"

    def await_answer(self, peer: int, sock: socket.socket, broken: Optional[str]) -> None:
        """Settle the send to ``peer`` from its answer (a thread per peer): its
        acknowledgement or refusal, else ``broken`` (a stream that broke gets
        :data:`_BROKEN_ANSWER_S` to say why), else what the wait for it ran into."""
        end_by = self.end_by
        if broken is not None or end_by is None:  # a broken stream, or a failure's trailer
            end_by = time.monotonic() + _BROKEN_ANSWER_S
        try:
            sock.settimeout(max(end_by - time.monotonic(), 1e-3))
            reply = transport.recv_message(sock)
        except (transport.PeerLost, ValueError) as exc:
            if broken is not None:
                self.settle(self.sent, peer, broken)
                return
            if time.monotonic() >= end_by:
                self.settle(self.sent, peer, self.timed_out(peer))
                return
            if isinstance(exc, transport.PeerLost):  # it closed: its writer died or ended
                self.stop_waiting_for(peer, f"it went away before sending its part ({exc})")
            outcome = f"no acknowledgement of rank {self.rank}'s part ({exc})"
        else:
            if reply.get("ok") is True:
                outcome = broken
            else:
                outcome = f"it refused rank {self.rank}'s part: {reply.get('error')}"
        self.settle(self.sent, peer, outcome)

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the run (settling what is open as timed out), then delete the published
        address, each step within :data:`~.exchange_run.CLOSE_GRACE_S` (idempotent)."""
        unsent = {peer: self.timed_out(peer) for peer in self.spec.peers}
        listener = [self.listener] if self.listener is not None else []
        if not self.close_run(unsent, listener) or not self.published:
            return
        if not self.store_lock.acquire(timeout=CLOSE_GRACE_S):
            logger.warning("rank %d: cannot delete its store key (the store is slow)", self.rank)
            return
        try:  # the same client, with a short bound
            store = transport.store_client(self.spec.store_host, self.spec.store_port,
                                           CLOSE_GRACE_S)
            store.delete_key(self.spec.key(self.rank))
        except Exception as exc:  # best effort: the key then outlives the save
            logger.warning("rank %d: cannot delete its store key: %s", self.rank, exc)
        finally:
            self.store_lock.release()

    def timed_out(self, peer: int) -> str:
        """What the send to ``peer`` was waiting for when its bound passed."""
        return f"timed out after {self.spec.timeout_s:g} s " + {
            "address": f"waiting for it to publish its address under '{self.spec.key(peer)}' "
            "(did it die, or not start this save?)",
            "connection": f"connecting to it at {self.address.get(peer)}",
            "transfer": f"sending rank {self.rank}'s part to it",
            "ack": f"waiting for it to acknowledge rank {self.rank}'s part",
        }[self.phase[peer]]
