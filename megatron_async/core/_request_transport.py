"""How a staged request travels to the persistent worker: tensors as shared-memory references.

Pickling a CPU tensor the way ``torch.multiprocessing`` does costs one file descriptor
and one socket round trip per tensor, every save, and moves the tensor's memory into
shared memory in place. Instead, every CPU tensor of a request is sent as a reference
``(segment id, byte offset, shape, dtype)`` into a shared-memory segment
(:mod:`megatron_async.core.shared_memory`):

* a tensor that already lives in a registered segment (our staging buffers) is sent as
  a reference: the data was staged into it, and stays leased until the call ends;
* any other CPU tensor (a request built by another library, whose staging returns the
  trainer's own tensors) is *copied* into a segment of this call (:class:`_CallArena`),
  so the worker always writes a snapshot.

Each segment crosses the process boundary once (one descriptor), the first time a
request uses it. The worker keeps a *reusable* segment (cached staging buffers) mapped
until the trainer says it is gone, and drops any other once the call that used it is
written, so no staging memory outlives its save in the worker.

Trainer side: :class:`RequestSender`. Worker side: :class:`SegmentTable`.
"""

from __future__ import annotations

import io
import pickle
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Dict, List, NamedTuple, Tuple

import torch

from megatron_async.core import shared_memory

__all__ = ["EncodedRequest", "RequestSender", "SegmentTable"]

_ALIGNMENT = 64
_ARENA_CHUNK_BYTES = 64 * 2**20

# The worker process's table; set by SegmentTable, read while unpickling a request.
_worker_segments: Dict[int, torch.Tensor] = {}


def _rebuild_tensor(segment_id: int, byte_offset: int, shape, dtype) -> torch.Tensor:
    """Unpickling side (worker): a tensor over the mapped segment ``segment_id``'s bytes."""
    return shared_memory.segment_view(_worker_segments[segment_id], byte_offset, shape, dtype)


def _rebuild_empty(size, dtype) -> torch.Tensor:
    """Unpickling side (worker): an empty tensor."""
    return torch.empty(size, dtype=dtype)


class EncodedRequest(NamedTuple):
    """A pickled request and what the worker must map or unmap before reading it."""

    payload: bytes
    new_segments: bytes
    """Pickled ``{segment id: uint8 tensor}`` of the segments the worker has not mapped yet
    (one descriptor each, which can be received only once)."""
    new_segment_ids: Tuple[int, ...]
    forget: Tuple[int, ...]
    """Segments the trainer no longer has: the worker unmaps them first."""
    call_segments: Tuple[int, ...]
    """Segments used by this call only (fresh staging buffers, the arena): the worker
    unmaps them once the call is written."""


class _CallArena:
    """Segments for CPU tensors of one call that are not staged in shared memory yet."""

    def __init__(self):
        self.chunks: List[torch.Tensor] = []
        self._used = 0

    def copy_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into the arena and return the (contiguous) copy."""
        num_bytes = tensor.numel() * tensor.element_size()
        start = -(-self._used // _ALIGNMENT) * _ALIGNMENT
        if not self.chunks or start + num_bytes > self.chunks[-1].numel():
            self.chunks.append(shared_memory.allocate_segment(max(num_bytes, _ARENA_CHUNK_BYTES)))
            start = 0
        self._used = start + num_bytes
        copy = shared_memory.segment_view(self.chunks[-1], start, tuple(tensor.shape), tensor.dtype)
        copy.copy_(tensor.detach())
        return copy


class _Pickler(ForkingPickler):
    """Pickles CPU tensors as segment references (see the module docstring)."""

    def __init__(self, file, sender: "RequestSender", arena: _CallArena):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._sender = sender
        self._arena = arena

    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if obj.device.type != "cpu" or obj.layout is not torch.strided or obj.is_quantized:
            return NotImplemented  # CUDA tensors go as CUDA IPC handles, as torch sends them
        if obj.numel() == 0:
            # torch would share the whole storage of an empty view; nothing to send.
            return _rebuild_empty, (tuple(obj.shape), obj.dtype)
        segment = shared_memory.find_segment(obj)
        if segment is None:
            segment = shared_memory.find_segment(self._arena.copy_in(obj))
        self._sender._use(segment)
        return _rebuild_tensor, (segment.segment_id, segment.byte_offset, tuple(obj.shape), obj.dtype)


class RequestSender:
    """Encodes requests for one persistent worker (trainer side).

    Tracks which segments that worker has mapped; create a new sender for a new worker.
    """

    def __init__(self):
        self._mapped: Dict[int, "weakref.ref[torch.Tensor]"] = {}
        self._new: Dict[int, shared_memory.Segment] = {}

    def _use(self, segment: shared_memory.Segment) -> None:
        if segment.segment_id not in self._mapped:
            self._new[segment.segment_id] = segment

    def encode(self, request: Any) -> Tuple[EncodedRequest, List[torch.Tensor]]:
        """Pickle ``request`` for the worker.

        Returns:
            The encoded request, and the arena segments this call copied tensors into;
            the caller keeps them until the call is over (they hold its snapshot).

        Raises:
            StagingMemoryError: no shared memory left for the copies.
            Whatever pickling raises for an unpicklable request.
        """
        arena = _CallArena()
        self._new = {}
        buffer = io.BytesIO()
        try:
            _Pickler(buffer, self, arena).dump(request)
            new_segments = bytes(
                ForkingPickler.dumps({sid: seg.tensor for sid, seg in self._new.items()})
            )
        finally:
            new, self._new = self._new, {}
        forget = tuple(
            sid for sid in self._mapped if not shared_memory.segment_is_alive(sid)
        )
        for sid in forget:
            del self._mapped[sid]
        call_segments = []
        for sid, segment in new.items():
            if segment.reusable:
                self._mapped[sid] = weakref.ref(segment.tensor)
            else:
                call_segments.append(sid)
        encoded = EncodedRequest(
            buffer.getvalue(), new_segments, tuple(new), forget, tuple(call_segments)
        )
        return encoded, arena.chunks


class SegmentTable:
    """The worker's mapped segments (background side)."""

    def apply(self, encoded: EncodedRequest) -> Any:
        """Unmap forgotten segments, map new ones, and return the unpickled request."""
        for sid in encoded.forget:
            _worker_segments.pop(sid, None)
        _worker_segments.update(pickle.loads(encoded.new_segments))
        return pickle.loads(encoded.payload)

    @staticmethod
    def drop(segment_ids: Tuple[int, ...]) -> None:
        """Unmap a finished call's arena segments."""
        for sid in segment_ids:
            _worker_segments.pop(sid, None)

    @staticmethod
    def mapped_ids() -> List[int]:
        """Ids of the segments mapped in this process (for tests)."""
        return sorted(_worker_segments)
