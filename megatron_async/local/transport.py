"""How background writers reach each other: the job's store, this node's address, messages.

:func:`store_address` runs in the training process: it finds the job's ``TCPStore``
behind the default process group, so that its host and port can travel in a save's
request. The rest runs in the background writer (a forked child or the persistent
worker), which cannot use the trainer's process groups nor its store connection: it
opens its own store client (:func:`store_client`, :func:`read_key`), listens on this
node's address (:func:`advertised_address`, :func:`listen`), connects to the address a
peer published (:func:`connect_published`), talks to peers in
length-prefixed JSON messages (:func:`send_message`, :func:`recv_message`,
:func:`answer_and_drain`), sends bulk bytes as length-prefixed frames (:func:`send_frame`)
and receives them straight into a stream's buffer (:func:`recv_frame_length`,
:func:`recv_into_stream`). :mod:`.part_replication` builds the replication of a part on
these.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch.distributed as dist

from megatron_async.core.one_per_process import OnePerProcess
from megatron_async.errors import LocalCheckpointError

__all__ = [
    "LOCAL_ADDR_ENV",
    "FAILED_PREFIX",
    "PeerLost",
    "StoreClients",
    "store_address",
    "store_client",
    "read_key",
    "connect_published",
    "advertised_address",
    "listen",
    "send_message",
    "recv_message",
    "answer_and_drain",
    "publish_failure",
    "forget_key",
    "send_frame",
    "recv_frame_length",
    "recv_into_stream",
    "close_socket",
    "shutdown_socket",
]

logger = logging.getLogger(__name__)

LOCAL_ADDR_ENV = "MEGATRON_ASYNC_LOCAL_ADDR"
"""The address peers reach this node's writers at; by default, the local end of the
route to the store's host."""

FAILED_PREFIX = "failed:"
"""Starts what a writer publishes under its address key instead of an address when it
will not take part in an exchange (its own part failed): its peers stop waiting for it."""

_LENGTH = struct.Struct("!I")
_FRAME = struct.Struct("!Q")
_MAX_MESSAGE_BYTES = 1 << 16
_DRAIN_BYTES = 1 << 16
_POLL_S = 0.05


class PeerLost(Exception):
    """A peer's connection broke, closed or timed out. Not an ``OSError``, so that code
    writing what it receives does not report it as a storage failure."""


def store_address(
    store: Optional[dist.Store] = None, *, required: bool = False
) -> Optional[Tuple[str, int]]:
    """The ``(host, port)`` of the job's TCPStore, for the writer's own client (training process).

    Args:
        store: the store to look behind; the default process group's when None.
        required: raise instead of returning None (replication was asked for).

    Returns:
        The address, behind any ``PrefixStore``s; None without a process group or when
        the store is not a ``TCPStore`` (peers cannot reach a file or hash store).

    Raises:
        LocalCheckpointError: ``required`` and there is no TCPStore.
    """
    if store is None and dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    if required:
        found = "no process group" if store is None else f"a {type(store).__name__}"
        raise LocalCheckpointError(
            f"local checkpoint replication needs the job's TCPStore, but there is {found}: "
            "initialize torch.distributed with torchrun, init_method='env://' or 'tcp://', "
            "or save local checkpoints without replication"
        )
    return None


class StoreClients(OnePerProcess):
    """This process's clients of the job's store, one per address (background writer).

    A forked writer gets its own instance: the parent's connections are not its to use,
    and a parent's thread may have held the lock at the fork.
    """

    fresh_in_forked_child = True

    def __init__(self):
        self._lock = threading.Lock()
        self._clients: Dict[Tuple[str, int], dist.TCPStore] = {}

    def client(self, host: str, port: int, timeout_s: float) -> dist.TCPStore:
        """The client of ``host:port``, created at the first ask; ``timeout_s`` bounds
        connecting and, until it is set again, each call."""
        timeout = datetime.timedelta(seconds=max(timeout_s, 1e-3))
        with self._lock:
            if (host, port) not in self._clients:
                self._clients[host, port] = dist.TCPStore(
                    host, port, is_master=False, wait_for_workers=False, timeout=timeout
                )
            self._clients[host, port].set_timeout(timeout)
            return self._clients[host, port]


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """This process's client of the store at ``host:port`` (background writer):
    :meth:`StoreClients.client` of :meth:`StoreClients.of_process`."""
    return StoreClients.of_process().client(host, port, timeout_s)


def read_key(store: dist.Store, key: str, timeout_s: float) -> Optional[str]:
    """``key``'s value if it is set, without waiting for it to be; each store call
    within ``timeout_s``."""
    store.set_timeout(datetime.timedelta(seconds=max(timeout_s, 1e-3)))
    return store.get(key).decode() if store.check([key]) else None


def connect_published(
    store: dist.Store,
    key: str,
    deadline: float,
    store_lock: threading.Lock,
    note: Callable[[Optional[str]], None],
    stopped: Callable[[], bool] = lambda: False,
) -> Tuple[Optional[socket.socket], Optional[str]]:
    """Connect to the ``ip:port`` a peer publishes under ``key`` (background writer).

    The key is read (each store call under ``store_lock``) until it is set, until the
    ``time.monotonic()`` deadline or ``stopped()``. ``note`` hears each step: None while
    the key is read, then the address tried (with why, when it is tried again). Keys name
    one save of one job, so an address that refuses is not an earlier attempt's: the
    peer's exchange is over (it died or ended), and it is not tried again; an unreachable
    one is (a network blip).

    Returns:
        ``(socket, None)`` once connected; ``(None, why)`` when the peer published a
        failure instead (:func:`publish_failure`; ``why`` starts with "its own part
        failed") or its address refused; ``(None, None)`` at the deadline or once
        ``stopped()``.
    """
    def failure(address: Optional[str]) -> Optional[str]:
        if address is not None and address.startswith(FAILED_PREFIX):
            return f"its own part failed ({address[len(FAILED_PREFIX):]})"
        return None

    while not stopped() and time.monotonic() < deadline:
        note(None)
        with store_lock:
            address = read_key(store, key, max(deadline - time.monotonic(), 1e-3))
        if failure(address) is not None:
            return None, failure(address)
        if address is not None:
            note(address)
            host, _, port = address.rpartition(":")
            try:
                timeout_s = max(deadline - time.monotonic(), 1e-3)
                return socket.create_connection((host.strip("[]"), int(port)), timeout_s), None
            except (ConnectionRefusedError, ValueError) as exc:
                with store_lock:  # a writer whose part failed publishes why, then closes
                    again = read_key(store, key, max(deadline - time.monotonic(), 1e-3))
                over = f"cannot connect to it at {address} (its exchange is over: {exc})"
                return None, failure(again) or over
            except OSError as exc:  # unreachable for now, or timed out: tried again
                note(f"{address} ({exc})")
        time.sleep(_POLL_S)
    return None, None


def publish_failure(host: str, port: int, key: str, reason: str, timeout_s: float = 2.0) -> None:
    """Publish under ``key`` that this writer will not take part in an exchange, and why
    (background writer, after its own part failed or it could not listen or publish its
    address), so that its peers stop waiting for it.
    Best effort: a failure to publish is logged, and the peers fail at their deadline."""
    try:
        store_client(host, port, timeout_s).set(key, FAILED_PREFIX + reason[:1000])
    except Exception as exc:
        logger.warning("cannot tell the peers waiting on %s that this writer failed: %s", key, exc)


def forget_key(host: str, port: int, key: str, timeout_s: float = 2.0) -> None:
    """Delete ``key`` from the store at ``host:port`` (any process; best effort, logged):
    what a save published there, once no peer reads it any more."""
    try:
        store_client(host, port, timeout_s).delete_key(key)
    except Exception as exc:
        logger.warning("cannot delete %s from the job's store: %s", key, exc)


def advertised_address(store_host: str, store_port: int) -> str:
    """The address peers reach this writer at (background writer).

    ``MEGATRON_ASYNC_LOCAL_ADDR`` if set; ``127.0.0.1`` when the store is on a loopback
    address; else the local end of the route to the store's host, found with a connected
    UDP socket (which sends nothing).

    Raises:
        LocalCheckpointError: the store's host cannot be resolved or routed to.
    """
    configured = os.environ.get(LOCAL_ADDR_ENV)
    if configured:
        return configured
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            store_host, store_port, type=socket.SOCK_DGRAM
        )[0]
        if ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return probe.getsockname()[0]
    except OSError as exc:
        raise LocalCheckpointError(
            f"cannot find this node's address on the route to the store host {store_host!r} "
            f"({exc}): set {LOCAL_ADDR_ENV} to an address the peer nodes reach"
        ) from exc


def listen(advertised: str, backlog: int) -> socket.socket:
    """A listening socket on an ephemeral port of ``advertised`` when it is a literal IP,
    else of every interface (background writer)."""
    try:
        ip = ipaddress.ip_address(advertised.strip("[]"))
    except ValueError:
        return socket.create_server(("", 0), backlog=backlog)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    return socket.create_server((str(ip), 0), family=family, backlog=backlog)


def send_message(sock: socket.socket, message: Dict[str, Any]) -> None:
    """Send a small JSON object, length first (within the socket's timeout)."""
    data = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> Dict[str, Any]:
    """Receive what :func:`send_message` sent (within the socket's timeout).

    Raises:
        PeerLost: the connection broke, closed or timed out first.
        ValueError: the bytes are not such a message (a stranger's connection).
    """
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > _MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {length} bytes is not from a peer's writer")
    message = json.loads(_recv_exactly(sock, length))
    if not isinstance(message, dict):
        raise ValueError("a message that is not an object is not from a peer's writer")
    return message


def answer_and_drain(sock: socket.socket, message: Dict[str, Any], deadline: float) -> None:
    """Send a last message, then read and drop what the peer still sends until it closes
    or the ``time.monotonic()`` deadline passes, so that the answer is not lost to a
    reset (best effort: a peer that went away reads a broken connection instead)."""
    try:
        send_message(sock, message)
        sock.shutdown(socket.SHUT_WR)
        while time.monotonic() < deadline:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            if not sock.recv(_DRAIN_BYTES):
                break
    except OSError:
        pass


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    data = bytearray()
    while len(data) < num_bytes:
        try:
            chunk = sock.recv(num_bytes - len(data))
        except OSError as exc:
            raise PeerLost(str(exc) or type(exc).__name__) from exc
        if not chunk:
            raise PeerLost("the connection closed")
        data += chunk
    return bytes(data)


def send_frame(sock: socket.socket, data: Any) -> None:
    """Send ``data`` (bytes-like; empty ends a stream of frames), its length first
    (within the socket's timeout). The bytes go from ``data`` itself, not a joined copy."""
    view = memoryview(data).cast("B")
    sock.sendall(_FRAME.pack(view.nbytes))
    if view.nbytes:
        sock.sendall(view)


def recv_frame_length(sock: socket.socket) -> int:
    """The length of the next frame :func:`send_frame` sent (0: the stream ended), within
    the socket's timeout; its bytes are then read with :func:`recv_into_stream`.

    Raises:
        PeerLost: the connection broke, closed or timed out first.
    """
    (length,) = _FRAME.unpack(_recv_exactly(sock, _FRAME.size))
    return length


def recv_into_stream(
    sock: socket.socket, num_bytes: int, deadline: float,
    free_space: Callable[[], memoryview], commit: Callable[[int], None],
) -> None:
    """Receive ``num_bytes`` straight into a stream's buffer, by the ``time.monotonic()``
    deadline: each ``recv_into`` fills the start of ``free_space()``, and ``commit`` takes
    the bytes received (a :class:`~megatron_async.buckets.bucket_file.BucketFile`'s chunk:
    no copy through a receive buffer).

    Raises:
        PeerLost: the connection broke, closed or timed out first.
    """
    done = 0
    while done < num_bytes:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            count = sock.recv_into(free_space()[: num_bytes - done])
        except OSError as exc:
            raise PeerLost(f"after {done} of {num_bytes} bytes: {exc}") from exc
        if not count:
            raise PeerLost(f"the connection closed after {done} of {num_bytes} bytes")
        commit(count)
        done += count


def shutdown_socket(sock: socket.socket) -> None:
    """Shut a socket down, waking a thread blocked on it, without closing it: its number
    stays taken until the thread is done with it (a blocked call keeps using the number
    it read at its start; closed, the number could name a file opened since)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected, or already shut


def close_socket(sock: socket.socket) -> None:
    """Shut a socket down and close it (its own thread, or no thread uses it)."""
    shutdown_socket(sock)
    sock.close()
