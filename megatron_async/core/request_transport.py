"""How a staged request travels to the persistent worker: tensors as shared-memory references.

Trainer side: :class:`RequestSender`, one per worker. Worker side:
:class:`~megatron_async.core.worker_loop.SegmentTable`, which reads what that sender wrote.

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

Each segment crosses the process boundary once: the first request that uses it names the
trainer's descriptor, which the worker (the trainer's child) opens as
``/proc/<trainer pid>/fd/<number>``; the number stays the segment's while the call holds
its staged data, and nothing is in flight for a worker that never reads the request.

A :class:`~megatron_async.core.shared_memory.ReusedTensorPairs` list (a cached bucket's
``(plan item, staged tensor)`` pairs) is sent once per worker, which keeps it decoded, and
then by token: a warm save with thousands of tensors pickles nothing per tensor on either
side.

Functions and classes the worker cannot import (the training script's, which the worker
never runs, lambdas, local functions) go by value, as cloudpickle pickles them, with the
values their globals have when the request is scheduled.
"""

from __future__ import annotations

import io
import itertools
import pickle
import sys
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import cloudpickle
import torch

from megatron_async.core import shared_memory
from megatron_async.errors import CoordinationError, UnpicklableRequestError

__all__ = ["EncodedRequest", "RequestSender"]

_ARENA_FIRST_CHUNK_BYTES = 2**20
_ARENA_CHUNK_BYTES = 64 * 2**20

def _from_table(method: str, *args: Any) -> Any:
    """What a pickled request calls for its segment references and reused pairs: the
    worker's unpickler (:mod:`megatron_async.core.worker_loop`) reads this name as a call
    of its SegmentTable's ``method``, so this body never runs there."""
    raise CoordinationError("decode a request for the persistent worker with SegmentTable.apply")


def _rebuild_empty(size, dtype) -> torch.Tensor:
    """Unpickling side (worker): an empty tensor."""
    return torch.empty(size, dtype=dtype)


class EncodedRequest(NamedTuple):
    """A pickled request and what the worker must map or unmap before reading it."""

    payload: bytes
    new_segments: Tuple[Tuple[int, int, int], ...]
    """``(segment id, the trainer's descriptor number, bytes)`` of the segments the worker
    has not mapped yet."""
    forget: Tuple[int, ...]
    """Segments the trainer no longer has: the worker unmaps them first."""
    call_segments: Tuple[int, ...]
    """Segments used by this call only (fresh staging buffers, the arena): the worker
    unmaps them once the call is written."""
    forget_pairs: Tuple[int, ...]
    """Tokens of reused pairs the trainer no longer has: the worker drops them first."""


class _CallArena:
    """Segments for CPU tensors of one call that are not staged in shared memory yet."""

    def __init__(self):
        self.chunks: List[torch.Tensor] = []
        self._used = 0

    def copy_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into the arena and return the (contiguous) copy."""
        num_bytes = tensor.numel() * tensor.element_size()
        start = shared_memory.aligned(self._used)
        if not self.chunks or start + num_bytes > self.chunks[-1].numel():
            # Chunks double with use, so a request with one small tensor takes little.
            chunk_bytes = min(_ARENA_CHUNK_BYTES, _ARENA_FIRST_CHUNK_BYTES << len(self.chunks))
            self.chunks.append(shared_memory.allocate_segment(max(num_bytes, chunk_bytes)))
            start = 0
        self._used = start + num_bytes
        copy = shared_memory.segment_view(self.chunks[-1], start, tuple(tensor.shape), tensor.dtype)
        copy.copy_(tensor.detach())
        return copy


class _Pickler(cloudpickle.Pickler):
    """Pickles CPU tensors as segment references and reused pairs as tokens (see the
    module docstring); functions and classes as cloudpickle does."""

    def __init__(self, file, sender: "RequestSender", arena: _CallArena):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._sender = sender
        self._arena = arena
        self._last: Optional[Tuple[int, int, int]] = None  # start, end, id of a segment
        self.segments: List[shared_memory.Segment] = []  # segments referred to

    def reducer_override(self, obj):
        if type(obj) is shared_memory.ReusedTensorPairs:
            return self._sender._reduce_pairs(obj, self._arena)
        if not isinstance(obj, torch.Tensor):
            return super().reducer_override(obj)
        if obj.device.type == "cuda":
            raise UnpicklableRequestError(
                f"the request holds a CUDA tensor (shape {tuple(obj.shape)}, "
                f"{obj.dtype}) that was not staged to host memory; the persistent worker is a "
                "fork of the trainer and cannot use CUDA: copy it to the host in the "
                "request's preload_fn"
            )
        if obj.device.type != "cpu" or obj.layout is not torch.strided or obj.is_quantized:
            return NotImplemented
        if obj.numel() == 0:
            # torch would share the whole storage of an empty view; nothing to send.
            return _rebuild_empty, (tuple(obj.shape), obj.dtype)
        segment_id, byte_offset = self._locate(obj)
        return _from_table, ("rebuild_tensor", segment_id, byte_offset, tuple(obj.shape), obj.dtype)

    def _locate(self, tensor: torch.Tensor) -> Tuple[int, int]:
        """``(segment id, byte offset)`` of ``tensor``'s data, copying it into the arena if needed."""
        start = tensor.data_ptr()
        last = self._last
        # Consecutive tensors of a bucket share a segment: check the last one first
        # (it stays alive for the whole request, so its address range is still its own).
        if (
            last is not None
            and last[0] <= start
            and start + tensor.numel() * tensor.element_size() <= last[1]
            and tensor.is_contiguous()
        ):
            return last[2], start - last[0]
        segment = shared_memory.find_segment(tensor)
        if segment is None:
            segment = shared_memory.find_segment(self._arena.copy_in(tensor))
        self._sender._use(segment)
        self.segments.append(segment)
        base = segment.tensor.data_ptr()
        self._last = (base, base + segment.tensor.numel(), segment.segment_id)
        return segment.segment_id, segment.byte_offset


class RequestSender:
    """Encodes requests for one persistent worker (trainer side).

    Tracks which segments and reused pairs that worker holds; create a new sender for a
    new worker.
    """

    def __init__(self):
        self._mapped: Dict[int, "weakref.ref[torch.Tensor]"] = {}
        self._new: Dict[int, shared_memory.Segment] = {}
        # id(ReusedTensorPairs) -> (token, the pairs): sent, and sent by the request
        # being encoded (forgotten if it fails)
        self._pairs: Dict[int, Tuple[int, "weakref.ref"]] = {}
        self._new_pairs: Dict[int, Tuple[int, "weakref.ref"]] = {}
        self._tokens = itertools.count(1)

    def _reduce_pairs(self, pairs: shared_memory.ReusedTensorPairs, arena: _CallArena) -> tuple:
        """``pairs`` by token if the worker has them; otherwise pickled, for it to keep.

        The worker's copy stays valid while ``pairs`` lives: it is never mutated, and its
        tensors keep their reusable segments alive, which each save stages into anew.
        """
        entry = self._pairs.get(id(pairs))
        if entry is not None and entry[1]() is pairs:
            return _from_table, ("cached_pairs", entry[0])
        buffer = io.BytesIO()
        pickler = _Pickler(buffer, self, arena)
        pickler.dump(list(pairs))
        if not all(segment.reusable for segment in pickler.segments):
            # An arena copy lives one call only: not kept.
            return _from_table, ("load_pairs", None, buffer.getvalue())
        token = next(self._tokens)
        self._new_pairs[id(pairs)] = (token, weakref.ref(pairs))
        return _from_table, ("load_pairs", token, buffer.getvalue())

    def _use(self, segment: shared_memory.Segment) -> None:
        if segment.segment_id not in self._mapped:
            self._new[segment.segment_id] = segment

    def _dump(self, request: Any, buffer: io.BytesIO, arena: _CallArena) -> None:
        main = sys.modules.get("__mp_main__")  # a spawned rank's script: the worker lacks it
        if main is not None:
            cloudpickle.register_pickle_by_value(main)
        try:
            _Pickler(buffer, self, arena).dump(request)
        except UnpicklableRequestError:
            raise
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise UnpicklableRequestError(
                f"the request cannot be pickled for the persistent worker ({type(exc).__name__}: "
                f"{exc}): async_fn, its arguments and what they refer to must pickle (a routine "
                "of the training script goes by value, with the globals, closure variables and "
                "defaults it uses: create such a value inside the routine, or pass it a request "
                "argument that pickles), or use the temporal caller "
                "(AsyncCallsQueue(persistent=False)), which forks and pickles nothing"
            ) from exc

    def encode(self, request: Any) -> Tuple[EncodedRequest, List[torch.Tensor]]:
        """Pickle ``request`` for the worker.

        Returns:
            The encoded request, and the arena segments this call copied tensors into;
            the caller keeps them until the call is over (they hold its snapshot).

        Raises:
            StagingMemoryError: no shared memory left for the copies.
            UnpicklableRequestError: something the request refers to does not pickle.
        """
        arena = _CallArena()
        self._new, self._new_pairs = {}, {}
        buffer = io.BytesIO()
        try:
            self._dump(request, buffer, arena)
            new_segments = tuple(
                (sid, seg.tensor.untyped_storage()._share_fd_cpu_()[0], seg.tensor.numel())
                for sid, seg in self._new.items()
            )
        finally:
            new, self._new = self._new, {}
            new_pairs, self._new_pairs = self._new_pairs, {}
        forget = tuple(sid for sid, segment in self._mapped.items() if segment() is None)
        for sid in forget:
            del self._mapped[sid]
        call_segments = []
        for sid, segment in new.items():
            if segment.reusable:
                self._mapped[sid] = weakref.ref(segment.tensor)
            else:
                call_segments.append(sid)
        dead_pairs = [key for key, (_, pairs) in self._pairs.items() if pairs() is None]
        forget_pairs = tuple(self._pairs.pop(key)[0] for key in dead_pairs)
        self._pairs.update(new_pairs)
        encoded = EncodedRequest(
            buffer.getvalue(), new_segments, forget, tuple(call_segments), forget_pairs
        )
        return encoded, arena.chunks
