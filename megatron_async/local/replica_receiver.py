"""The receiving side of a part's replication: peers' parts admitted, written and acknowledged.

Runs in the **background writer**, on threads of one
:class:`~megatron_async.local.part_replication.PartReplication`, whose shared state
(:class:`~megatron_async.local.exchange_run.ExchangeRun`) is all it sees: one accepts the
peers' connections on the run's listener, and one per connection receives a part. A part is
kept only when its header names this save (session, iteration, this rank as receiver),
its owner is one of this rank's peers not received yet, and its owner's job identity is
this job's. Its frames are received straight into the chunk of the replica's file
(:func:`~megatron_async.local.transport.recv_into_stream` into
:func:`~megatron_async.local.part_output.open_part`) as the owner writes its part; the
last one is followed by the part's size and digest, and the replica is acknowledged only
once it is durable and hashed to that digest. Otherwise the sender is told why
(:func:`~megatron_async.local.transport.answer_and_drain`); an owner whose own part
failed says so in place of the digest, and its replica is dropped.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Dict, Optional

from megatron_async.errors import CheckpointIntegrityError, StorageWriteError
from megatron_async.local import transport
from megatron_async.local.exchange_run import ExchangeRun
from megatron_async.local.part_output import open_part
from megatron_async.local.parts import LocalIdentity

__all__ = ["ReplicaReceiver"]

logger = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.1


class _Refused(Exception):
    """``(reason, owner)``: a refused header; the reason goes back, the owner's replica fails."""


class _OwnerFailed(Exception):
    """The owner's own part failed while it was streaming it: no replica."""


class ReplicaReceiver:
    """Receive the peers' parts of one exchange run (background writer, the run's threads).

    Args:
        run: the replication's run: its ``receiving`` and ``received`` are the receiver's
            to fill (under ``run.cond``; ``received`` through ``run.settle``).
    """

    def __init__(self, run: ExchangeRun):
        self.run = run
        self.rank = run.rank

    def accept_loop(self, listener: socket.socket) -> None:
        """Accept peers' connections, each received on a thread, until all settled."""
        run = self.run
        listener.settimeout(_ACCEPT_POLL_S)
        while not run.closed and len(run.received) < len(run.spec.peers):
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # closed
            if run.register(conn):
                run.start(self.receive, conn)

    def receive(self, conn: socket.socket) -> None:
        """Keep a peer's part as a replica if its header and digest check out; answer."""
        run, owner = self.run, None
        try:
            conn.settimeout(run.spec.timeout_s)
            header = transport.recv_message(conn)
            owner = self.admit(header)
            with open_part(
                run.spec.directory, run.iteration, owner, LocalIdentity(**header["identity"])
            ) as stream:
                self.receive_frames(conn, stream, owner)
            replica = stream.record
        except _Refused as exc:
            self.refuse(conn, exc.args[1], exc.args[0])
        except _OwnerFailed as exc:
            run.settle(run.received, owner, f"its own part failed ({exc})")
        except (CheckpointIntegrityError, StorageWriteError) as exc:
            self.refuse(conn, owner, str(exc))
        except Exception as exc:  # a broken connection, or a stranger's bytes
            what = f"receiving its part failed: {type(exc).__name__}: {exc}"
            if owner is None:
                logger.warning("rank %d: a connection to the exchange ended: %s", self.rank, what)
            run.settle(run.received, owner, what)
        else:
            try:  # before settling: the last settle closes every connection
                transport.send_message(conn, {"ok": True})
            except OSError as exc:
                logger.warning("rank %d: cannot ack rank %d's part: %s", self.rank, owner, exc)
            run.settle(run.received, owner, replica)
        finally:
            transport.close_socket(conn)

    def receive_frames(self, conn: socket.socket, stream: Any, owner: int) -> None:
        """Receive the part's frames into ``stream``, then its size and digest (each
        frame within the exchange's timeout)."""
        timeout_s = self.run.spec.timeout_s
        while True:
            conn.settimeout(timeout_s)
            length = transport.recv_frame_length(conn)
            if not length:
                break
            transport.recv_into_stream(
                conn, length, time.monotonic() + timeout_s, stream.free_space, stream.commit
            )
        trailer = transport.recv_message(conn)
        if "error" in trailer:
            raise _OwnerFailed(trailer["error"])
        if trailer["num_bytes"] != stream.tell():
            raise CheckpointIntegrityError(
                f"replica of rank {owner}'s part holds {stream.tell()} bytes, its owner "
                f"sent {trailer['num_bytes']}"
            )
        stream.expected_digest = trailer["digest"]

    def admit(self, header: Dict[str, Any]) -> int:
        """The owner of an incoming part, if this rank expects it; else :class:`_Refused`."""
        run, owner = self.run, header["owner"]
        peers = run.spec.peers
        peer = owner if owner in peers else None
        expected = (run.spec.session_id, run.iteration, self.rank)
        found = (header["session_id"], header["iteration"], header["receiver"])
        if found != expected or peer is None:
            raise _Refused(
                f"rank {self.rank} expects its peers' {peers} parts for (session, "
                f"iteration, receiver) {expected}, not rank {owner}'s for {found}", peer,
            )
        differences = run.identity.differences(LocalIdentity(**header["identity"]))
        if differences:
            raise _Refused(f"rank {owner}'s part is another job's ({', '.join(differences)})", peer)
        with run.cond:
            if owner in run.receiving or owner in run.received:
                raise _Refused(f"rank {self.rank} already receives rank {owner}'s part", None)
            run.receiving.add(owner)
        return owner

    def refuse(self, conn: socket.socket, owner: Optional[int], reason: str) -> None:
        """Tell the sender why its part is not kept, and drain what it still sends so the
        answer is not lost to a reset; only then settle (which may close the connection)."""
        deadline = time.monotonic() + self.run.spec.timeout_s
        transport.answer_and_drain(conn, {"ok": False, "error": reason}, deadline)
        if owner is None:
            logger.warning("rank %d: refused a part: %s", self.rank, reason)
        self.run.settle(self.run.received, owner, f"its part was refused: {reason}")
