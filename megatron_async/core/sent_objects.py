"""Plan items that cross to the persistent worker once and are then named by a token.

Used by :mod:`megatron_async.core.request_transport` while it encodes a request (trainer
side); the worker keeps the items it received in a table of its own
(:class:`~megatron_async.core.request_receiver.SegmentTable`), keyed by the same tokens.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any, Dict, Tuple

__all__ = ["KEEP_UNUSED_OBJECTS", "SentObjects"]

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
