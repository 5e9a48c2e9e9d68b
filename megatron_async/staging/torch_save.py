"""Staging a ``torch.save`` file within the staging budget: :func:`stage_torch_save`.

Runs in the trainer, in the ``preload_fn`` of
:meth:`~megatron_async.torch_ckpt.TorchAsyncCheckpoint.async_save`; the background writer
(:mod:`megatron_async.writer.torch_save_file`) only reads a :class:`TorchSaveStaged`. The
object is pickled at once as ``torch.save`` pickles it (storages at location ``cpu``), and
the storages' bytes are copied within the budget of :mod:`megatron_async.staging.budget`,
in one go or in rounds (see "Staging memory budget" in docs/design.md). The records are
``torch.save``'s, in its order: the file is byte-identical to ``torch.save`` into a file
object (of the host copy, for device tensors).
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.serialization import location_tag, normalize_storage_type

from megatron_async.core import shared_memory
from megatron_async.errors import CheckpointValidationError
from megatron_async.staging.budget import StagingBufferCache, StagingLedger, resolve_budget
from megatron_async.staging.overlapped import StagedData, watch
from megatron_async.staging.rounds import copy_first_round, plan_rounds
from megatron_async.staging.gate import StagingGate

__all__ = ["TorchSaveStaged", "pickle_like_torch_save", "stage_torch_save"]

_ADVICE = "Do not change saved tensors until async_save returns, or raise staging_memory_limit"

_FORMAT_VERSION = b"1"
"""The ``.format_version`` record ``torch.save`` writes (storages numbered in order)."""


_PLAIN_TYPES = frozenset({str, bytes, int, float, bool, type(None), tuple, list, dict, torch.Size, torch.dtype})
"""Types that are never a storage (the pickler asks about every object it meets)."""


def pickle_like_torch_save(
    obj: Any, pickle_module: Any = pickle, pickle_protocol: int = 2, device_locations: bool = False
) -> Tuple[bytes, List[torch.UntypedStorage], List[List[torch.Tensor]]]:
    """Pickle ``obj`` into the ``data.pkl`` record of a ``torch.save`` file (trainer).

    Returns the record, the storages it names (storage ``i`` is record ``data/i``) and the
    tensors seen over each. A storage is keyed by its first appearance, so two tensors
    over one storage share one record, as in ``torch.save``. CUDA storages are recorded
    at location ``cpu`` (they load on the CPU), or at their device (``cuda:1``, as
    ``torch.save`` records them) with ``device_locations``.

    Raises:
        CheckpointValidationError: two saved tensors view the same data as different
            types, which ``torch.load`` cannot restore (``torch.save`` refuses it too).
    """
    keys: Dict[int, str] = {}
    storages: List[torch.UntypedStorage] = []
    tensors: Dict[int, List[torch.Tensor]] = {}
    dtypes: Dict[int, torch.dtype] = {}

    def storage_id(value: Any) -> Optional[tuple]:
        if type(value) in _PLAIN_TYPES:  # most objects pickled: the fast way out
            return None
        if isinstance(value, torch.Tensor):
            try:  # remembered for its version counter; sparse and other layouts have none
                tensors.setdefault(value.untyped_storage()._cdata, []).append(value)
            except (RuntimeError, NotImplementedError):
                pass
            return None
        if isinstance(value, torch.storage.TypedStorage):
            untyped, dtype, numel = value._untyped_storage, value.dtype, value._size()
            storage_type = getattr(torch, value._pickle_storage_type())
        elif torch.is_storage(value):
            untyped, dtype, numel = value, torch.uint8, value.nbytes()
            storage_type = normalize_storage_type(type(value))
        else:
            return None
        if untyped.device.type != "meta" and untyped.data_ptr() != 0:
            if dtypes.setdefault(untyped.data_ptr(), dtype) != dtype:
                raise CheckpointValidationError(
                    "cannot save two tensors or storages that view the same data as different "
                    "types (torch.save refuses it too); save a copy of one of them"
                )
        key = keys.get(untyped._cdata)
        if key is None:
            key = keys[untyped._cdata] = str(len(storages))
            storages.append(untyped)
        kind = untyped.device.type
        on_host = kind == "cpu" or (kind == "cuda" and not device_locations)
        location = "cpu" if on_host else location_tag(untyped)
        return ("storage", storage_type, key, location, numel)

    class _Pickler(pickle_module.Pickler):  # type: ignore[name-defined]
        persistent_id = staticmethod(storage_id)  # asked for every object: one call, not two

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle_protocol).dump(obj)
    return buffer.getvalue(), storages, [tensors.get(storage._cdata, []) for storage in storages]


class TorchSaveStaged(StagedData):
    """The records of one ``torch.save`` file, staged (trainer builds it, the writer reads it).

    ``header``: ``(name, bytes)`` records written first (``data.pkl`` and the format
    records); ``records``: ``(name, byte offset in buffer or None when empty, num_bytes)``
    per storage, in order; ``buffer``: the shared-memory segment holding them; ``gate``:
    the save's gate (item ``i`` is ``records[i]``). Scheduling waits for the later rounds'
    copies; pickled (to the persistent worker), only the fields above travel.
    """

    scheduling_waits = True

    def __init__(self, header, records, buffer, gate: StagingGate, alignment: int, crc32: bool):
        self.header: List[Tuple[str, bytes]] = header
        self.records: List[Tuple[str, Optional[int], int]] = records
        self.buffer: Optional[torch.Tensor] = buffer
        self.gate = gate
        self.alignment = alignment
        self.crc32 = crc32

    def __reduce__(self):
        return (TorchSaveStaged, (self.header, self.records, self.buffer, self.gate,
                                  self.alignment, self.crc32))

    def release(self) -> None:
        """Trainer: the writer is done with the staged bytes."""
        super().release()
        self.buffer = None  # a segment of this save alone is freed here


def _storage_copy(
    storage: torch.UntypedStorage, buffer: torch.Tensor, offset: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(source, target)``: one storage's bytes and their place in ``buffer`` at ``offset``,
    viewed in the widest elements the size allows (trainer).

    A byte-wise copy of a large storage has 8x the elements, which torch splits over its
    thread pool much sooner (slow when busy)."""
    num_bytes = storage.nbytes()
    source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    target = buffer[offset : offset + num_bytes]
    for dtype in (torch.int64, torch.int32, torch.int16):
        if num_bytes % dtype.itemsize == 0 and source.data_ptr() % dtype.itemsize == 0:
            return source.view(dtype), target.view(dtype)
    return source, target


def _tensor_names(obj: Any, prefix: str = "", names: Optional[Dict[int, str]] = None) -> Dict[int, str]:
    """``storage id -> path`` of the tensors in ``obj``'s dicts, lists and tuples (for messages)."""
    names = {} if names is None else names
    if isinstance(obj, torch.Tensor):
        try:
            names.setdefault(obj.untyped_storage()._cdata, prefix or "<object>")
        except (RuntimeError, NotImplementedError):
            pass
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _tensor_names(value, f"{prefix}.{key}" if prefix else str(key), names)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _tensor_names(value, f"{prefix}[{i}]", names)
    return names


class _KeptSegment:
    """A segment kept in a :class:`StagingBufferCache` for the next save of the same size."""

    __slots__ = ("segment",)

    def __init__(self, segment: torch.Tensor):
        self.segment = segment

    def num_bytes(self) -> int:
        return self.segment.numel()


def _segment(cache: Optional[StagingBufferCache], num_bytes: int, pinned: bool):
    """``(segment, loan)``: the segment a save within the budget stages into (trainer).

    With a ``cache``, the segment its last save of this size used, once that save's loan
    is over (its writer read everything), under a new loan; a new segment, kept for the
    next save, otherwise. Without one (or while the kept one is still read), a segment of
    this save alone and no loan. A failed allocation ends the loan (the cache lends
    again)."""
    kept, loan = (None, None) if cache is None else cache.lend(("torch.save", num_bytes, pinned), 1)
    if kept is not None and kept[0] is not None:
        return kept[0].segment, loan
    try:
        segment = shared_memory.allocate_segment(num_bytes, reusable=kept is not None)
        if pinned:
            shared_memory.pin_segment(segment)
    except BaseException:
        _drop(cache, loan)
        raise
    if kept is not None:
        kept[0] = _KeptSegment(segment)
    return segment, loan


def _drop(cache: Optional[StagingBufferCache], loan) -> None:
    """A save's staging failed: its segment leaves the cache (a device copy that timed
    out may still land in it; the next save allocates anew) and its loan ends."""
    if loan is not None:
        cache.forget(loan)
        loan.end()


def stage_torch_save(
    obj: Any,
    pickle_module: Any,
    pickle_protocol: int,
    byteorder_record: bool,
    limit: Any,
    timeout_s: float,
    stats: dict,
    *,
    device_locations: bool = False,
    cache: Optional[StagingBufferCache] = None,
    crc32: Optional[bool] = None,
) -> TorchSaveStaged:
    """Pickle ``obj`` and stage its storages within the budget (trainer, ``preload_fn``).

    ``stats`` receives ``rounds`` and ``peak_bytes`` (the staging bytes held) of this save.
    ``device_locations``: see :func:`pickle_like_torch_save`. ``cache``: the owner's
    (a manager's, a checkpointer's) cache that keeps a state's staging segment from one
    save to the next, as the bucket layouts' buffers are kept, instead of allocating
    shared memory on every save; None: a segment per save. ``crc32``: whether the zip
    records carry CRC-32s (None: as ``torch.save``, ``get_crc32_options()``); False where
    the caller hashes the whole file itself (a local checkpoint part), which spares the
    writer one pass over the bytes. ``torch.load`` reads the file either way.

    Raises:
        StagingMemoryError: one storage alone exceeds the budget (naming its tensor and
            the budget it needs), or earlier saves did not free the memory within
            ``timeout_s``; nothing was staged and the trainer's state is untouched.
    """
    data, storages, tensors = pickle_like_torch_save(obj, pickle_module, pickle_protocol, device_locations)
    sizes = [storage.nbytes() for storage in storages]
    state_bytes = sum(shared_memory.aligned(size) for size in sizes)
    budget = resolve_budget(limit, state_bytes)
    by_storage = _tensor_names(obj) if state_bytes > budget else {}
    names = [by_storage.get(storage._cdata, f"data/{i}") for i, storage in enumerate(storages)]
    plan = plan_rounds(sizes, names, min(state_bytes, budget))
    in_rounds = plan.rounds > 1
    cuda = any(storage.device.type == "cuda" for storage in storages)
    alignment = torch.serialization._get_storage_alignment()  # as torch.save's writer
    header = [("data.pkl", data), (".format_version", _FORMAT_VERSION),
              (".storage_alignment", str(alignment).encode())]
    if byteorder_record:
        header.append(("byteorder", sys.byteorder.encode()))
    records = [(f"data/{i}", offset, size) for i, (offset, size) in enumerate(zip(plan.offsets, sizes))]
    gate = StagingGate(len(storages))
    if crc32 is None:
        crc32 = torch.serialization.get_crc32_options()

    def stage_into(pool: Optional[torch.Tensor]) -> TorchSaveStaged:
        buffer, loan = pool, None
        if in_rounds:
            gate.start_rounds()
        elif plan.pool_bytes:
            buffer, loan = _segment(cache, plan.pool_bytes, cuda)
        try:
            staged = TorchSaveStaged(header, records, buffer, gate, alignment, crc32)
            staged.loan = loan
            items = [
                (idx, names[idx], *_storage_copy(storage, buffer, offset), watch(*tensors[idx]))
                for idx, (storage, offset) in enumerate(zip(storages, plan.offsets))
                if offset is not None
            ]
            staged.copy_job = copy_first_round(gate, plan, items, buffer, False, timeout_s,
                                               "torch.save staging in rounds", _ADVICE)
        except BaseException:
            _drop(cache, loan)
            raise
        return staged

    staged = StagingLedger.of_process().stage_within(
        stage_into, state_bytes=state_bytes, budget=budget, in_rounds=in_rounds, gate=gate,
        pinned=cuda, timeout_s=timeout_s,
    )
    stats.update(rounds=plan.rounds, peak_bytes=plan.pool_bytes)
    return staged
