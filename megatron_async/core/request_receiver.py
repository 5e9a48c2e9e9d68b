"""How the persistent worker reads a request the trainer sent: :class:`SegmentTable`
(background side; the trainer's half, and the format, are in
:mod:`megatron_async.core.request_transport`)."""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, Dict, Tuple

import torch

from megatron_async.core import request_transport, shared_memory
from megatron_async.core.request_transport import EncodedRequest
from megatron_async.errors import CoordinationError

__all__ = ["SegmentTable"]


class SegmentTable:
    """The segments and plan items one worker has received, and the decoding of requests
    that refer to them (background side: one per worker, fed by one
    :class:`RequestSender`)."""

    def __init__(self, trainer_pid: int):
        self._trainer_pid = trainer_pid
        self._segments: Dict[int, torch.Tensor] = {}
        self._objects: Dict[int, Any] = {}

    def apply(self, encoded: EncodedRequest) -> Any:
        """Unmap forgotten segments, map new ones, and return the unpickled request.

        Raises:
            CoordinationError: a new segment cannot be opened through ``/proc``.
        """
        for sid in encoded.forget:
            self._segments.pop(sid, None)
        for sid, number, num_bytes in encoded.new_segments:
            path = f"/proc/{self._trainer_pid}/fd/{number}"
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                raise CoordinationError(
                    f"persistent worker: cannot open the trainer's staging segment {sid} as "
                    f"{path} ({exc}); the worker maps the trainer's shared memory through /proc, "
                    "which a system that hides a process's descriptors from its own children "
                    "refuses: use the temporal caller (AsyncCallsQueue(persistent=False))"
                ) from exc
            try:
                storage = torch.UntypedStorage._new_shared_fd_cpu(fd, num_bytes)
            finally:
                os.close(fd)
            self._segments[sid] = torch.empty(0, dtype=torch.uint8).set_(storage)
        for token in encoded.forget_objects:
            self._objects.pop(token, None)
        self._objects.update(pickle.loads(encoded.new_objects))
        return self.load(encoded.payload)

    def load(self, payload: bytes) -> Any:
        """Unpickle ``payload``, resolving its references to segments and plan items here."""
        return _Unpickler(io.BytesIO(payload), self).load()

    def rebuild_tensor(self, segment_id: int, byte_offset: int, shape, dtype) -> torch.Tensor:
        """A tensor over the mapped segment ``segment_id``'s bytes."""
        segment = self._received(self._segments, segment_id, "shared-memory segment")
        return shared_memory.segment_view(segment, byte_offset, shape, dtype)

    def cached_object(self, token: int) -> Any:
        """A plan item sent with this or an earlier request."""
        return self._received(self._objects, token, "plan item")

    @staticmethod
    def _received(table: Dict[int, Any], key: int, what: str) -> Any:
        entry = table.get(key)
        if entry is None:
            raise CoordinationError(
                f"persistent worker: {what} {key} was never received here; the trainer and "
                "this worker disagree on what was sent (the worker exits and a new one starts "
                "with the next save)"
            )
        return entry

    def drop(self, segment_ids: Tuple[int, ...]) -> None:
        """Unmap a finished call's arena segments (the worker's writer thread)."""
        for sid in segment_ids:
            self._segments.pop(sid, None)


class _Unpickler(pickle.Unpickler):
    """Reads what the trainer's pickler wrote: its references by name to the placeholders
    of :mod:`~megatron_async.core.request_transport` become the methods of one
    :class:`SegmentTable` (background side)."""

    def __init__(self, file, table: SegmentTable):
        super().__init__(file)
        self._resolved = {
            "_rebuild_tensor": table.rebuild_tensor,
            "_cached_object": table.cached_object,
            "_load_pairs": table.load,
        }

    def find_class(self, module: str, name: str) -> Any:
        if module == request_transport.__name__ and name in self._resolved:
            return self._resolved[name]
        return super().find_class(module, name)
