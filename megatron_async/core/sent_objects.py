"""What crosses to the persistent worker once and is then named by id.

Used by :mod:`megatron_async.core.request_transport` while it encodes a request:

* plan items (:class:`SentObjects`, trainer side): sent once, then named by a token; the
  worker keeps the items it received in a table of its own, keyed by the same tokens;
* shared-memory segments: each segment's descriptor crosses once, over a Unix socket of
  its own (:func:`send_descriptors` on the trainer, :func:`receive_descriptors` in the
  worker); requests then name the segment by its id.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
from typing import Any, Dict, List, Tuple

import torch

from megatron_async.errors import CoordinationError

__all__ = [
    "DESCRIPTOR_TIMEOUT_S",
    "KEEP_UNUSED_OBJECTS",
    "SentObjects",
    "receive_descriptors",
    "send_descriptors",
]

KEEP_UNUSED_OBJECTS = 1024
"""Plan items not used by the latest request that a sender keeps (a structure that
alternates, e.g. two models saved in turn, still finds its items)."""


class SentObjects:
    """The plan items (``WriteItem``) a worker already has, by token (trainer side).

    A warm save with a cached plan sends the same immutable ``WriteItem`` objects again;
    pickling their ~10 objects each was most of the cost of sending a request with
    thousands of tensors. Each item is sent once and then referred to by its token. The
    sender keeps the items it sent alive (so their ``id`` stays theirs) and forgets
    those the latest request did not use once they exceed ``KEEP_UNUSED_OBJECTS``.
    """

    def __init__(self):
        self._tokens: Dict[int, Tuple[int, Any]] = {}  # id(item) -> (token, item)
        self._next = itertools.count(1)
        self._used: set = set()
        self._new: Dict[int, Tuple[int, Any]] = {}  # token -> (id(item), item)
        self.epoch = 0
        """Counts the times tokens were dropped: bytes encoded in an earlier epoch may
        name tokens the worker no longer has."""

    def start_request(self) -> None:
        self._used, self._new = set(), {}

    def token_of(self, item: Any) -> int:
        entry = self._tokens.get(id(item))
        if entry is None:
            entry = (next(self._next), item)
            self._tokens[id(item)] = entry
            self._new[entry[0]] = (id(item), item)
        self._used.add(entry[0])
        return entry[0]

    def use_tokens(self, tokens: Tuple[int, ...]) -> None:
        """Count tokens embedded in reused bytes as used by this request."""
        self._used.update(tokens)

    def finish_request(self) -> Tuple[bytes, Tuple[int, ...]]:
        """Return the pickled new items and the tokens the worker may drop."""
        new_objects = pickle.dumps(
            {token: item for token, (_, item) in self._new.items()}, pickle.HIGHEST_PROTOCOL
        )
        forget: Tuple[int, ...] = ()
        unused = len(self._tokens) - len(self._used)
        if unused > KEEP_UNUSED_OBJECTS:
            stale = [key for key, (token, _) in self._tokens.items() if token not in self._used]
            forget = tuple(self._tokens.pop(key)[0] for key in stale)
            self.epoch += 1
        self._new = {}
        return new_objects, forget

    def abandon_request(self) -> None:
        """Forget the items first sent by a request that was never sent."""
        for key, _ in self._new.values():
            self._tokens.pop(key, None)
        self._new = {}
        self.epoch += 1


_MAX_DESCRIPTORS_PER_MESSAGE = 200
"""SCM_RIGHTS carries at most 253 descriptors per message on Linux."""

DESCRIPTOR_TIMEOUT_S = 60.0
"""Bound on sending or receiving one batch of segment descriptors. Internal, not a user's
bound: the descriptors go over a local socket just before their request, so a batch that
does not move for this long means the other end is gone."""


def send_descriptors(sock: socket.socket, segments: List[torch.Tensor]) -> None:
    """Send the segments' shared-memory descriptors to the worker (trainer side).

    The kernel holds descriptors in flight on the socket: if the worker dies before
    taking them, closing the socket releases them, so a dead worker never pins the
    shared memory of a request it did not read.
    """
    fds = [segment.untyped_storage()._share_fd_cpu_()[0] for segment in segments]
    for start in range(0, len(fds), _MAX_DESCRIPTORS_PER_MESSAGE):
        socket.send_fds(sock, [b"\0"], fds[start : start + _MAX_DESCRIPTORS_PER_MESSAGE])


def receive_descriptors(sock: socket.socket, count: int) -> List[int]:
    """Receive ``count`` descriptors sent by :func:`send_descriptors` (worker side)."""
    fds: List[int] = []
    while len(fds) < count:
        try:
            data, received, _flags, _addr = socket.recv_fds(sock, 1, _MAX_DESCRIPTORS_PER_MESSAGE)
        except socket.timeout as exc:
            for fd in fds:
                os.close(fd)
            raise CoordinationError(
                f"the trainer announced {count} shared-memory segments but their descriptors "
                f"did not arrive within {DESCRIPTOR_TIMEOUT_S:.0f}s"
            ) from exc
        if not data:
            raise CoordinationError("the trainer closed the descriptor socket")
        fds.extend(received)
    return fds
