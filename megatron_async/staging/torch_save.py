"""Staging a ``torch.save`` file within the staging budget: :func:`stage_torch_save`.

Runs in the trainer, in the ``preload_fn`` of
:meth:`~megatron_async.torch_ckpt.TorchAsyncCheckpoint.async_save`; the background writer
(:mod:`megatron_async.writer.torch_save_file`) only reads a :class:`TorchSaveStaged`.

* The object is pickled at once, the way ``torch.save`` pickles it: each storage becomes
  a persistent id naming its record ``data/<key>``. Everything but the storages' bytes is
  therefore frozen when scheduling returns, whatever the object holds. Storages are
  recorded at location ``cpu`` (the host copy is what is written), so the file loads on
  a machine without the device, as the reference library's files do;
* the storages' bytes are copied into shared memory within the ``staging_memory_limit``
  of :mod:`megatron_async.staging.budget` (the same ledger, so torch_dist saves and these
  share one budget; by default one copy of the object's storages). A save that fits is
  copied in one go into a segment of its own; a larger one in rounds through the
  ledger's pool, placed by :func:`~megatron_async.staging.rounds.plan_rounds`: the writer
  writes record by record and marks each written, and the copy thread copies a storage
  once the writer wrote the storages whose bytes it overwrites. Scheduling returns once
  every storage is copied (``hand_over``); a tensor changed in place before its copy
  fails the save (``StagingRaceError``), as staging in rounds does for torch_dist saves.

The records are the ones ``torch.save`` writes to a file object, in the same order, so
the file is byte-identical to ``torch.save(obj, open(path, "wb"))`` (for CPU tensors; for
device tensors, to saving their host copy).
"""

from __future__ import annotations

import io
import logging
import pickle
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.serialization import location_tag, normalize_storage_type

from megatron_async.core import shared_memory
from megatron_async.errors import CheckpointValidationError
from megatron_async.staging.budget import StagingLedger, resolve_budget
from megatron_async.staging.copy_job import StagedData, watch
from megatron_async.staging.rounds import copy_first_round, plan_rounds
from megatron_async.staging.gate import StagingGate

__all__ = ["TorchSaveStaged", "pickle_like_torch_save", "stage_torch_save"]

logger = logging.getLogger(__name__)

_ADVICE = "Do not change saved tensors until async_save returns, or raise staging_memory_limit"

_FORMAT_VERSION = b"1"
"""The ``.format_version`` record ``torch.save`` writes (storages numbered in order)."""


_PLAIN_TYPES = frozenset({str, bytes, int, float, bool, type(None), tuple, list, dict, torch.Size, torch.dtype})
"""Types that are never a storage (the pickler asks about every object it meets)."""


class _SavedStorage:
    """One storage of the pickled object: its record key and the tensors seen over it."""

    __slots__ = ("key", "storage", "tensors")

    def __init__(self, key: str, storage: torch.UntypedStorage):
        self.key = key
        self.storage = storage
        self.tensors: List[torch.Tensor] = []

    @property
    def num_bytes(self) -> int:
        return self.storage.nbytes()


def pickle_like_torch_save(
    obj: Any, pickle_module: Any = pickle, pickle_protocol: int = 2
) -> Tuple[bytes, List[_SavedStorage]]:
    """Pickle ``obj`` into the ``data.pkl`` record of a ``torch.save`` file (trainer).

    Returns the record and the storages it names, in key order. A storage is keyed by its
    first appearance, so two tensors over one storage share one record, as in
    ``torch.save``.

    Raises:
        CheckpointValidationError: two saved tensors view the same data as different
            types, which ``torch.load`` cannot restore (``torch.save`` refuses it too).
    """
    by_storage: Dict[int, _SavedStorage] = {}
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
        entry = by_storage.get(untyped._cdata)
        if entry is None:
            entry = by_storage[untyped._cdata] = _SavedStorage(str(len(by_storage)), untyped)
        location = "cpu" if untyped.device.type in ("cpu", "cuda") else location_tag(untyped)
        return ("storage", storage_type, entry.key, location, numel)

    class _Pickler(pickle_module.Pickler):  # type: ignore[name-defined]
        persistent_id = staticmethod(storage_id)  # asked for every object: one call, not two

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle_protocol).dump(obj)
    storages = list(by_storage.values())
    for entry in storages:
        entry.tensors = tensors.get(entry.storage._cdata, [])
    return buffer.getvalue(), storages


class TorchSaveStaged(StagedData):
    """The records of one ``torch.save`` file, staged (trainer builds it, the writer reads it).

    ``header``: ``(name, bytes)`` records written first (``data.pkl`` and the format
    records); ``records``: ``(name, byte offset in buffer or None when empty, num_bytes)``
    per storage, in order; ``buffer``: the shared-memory segment holding them; ``gate``:
    the save's gate (item ``i`` is ``records[i]``). In rounds, the later rounds' copies
    (:class:`~.copy_job.StagedData`), which scheduling waits for. Pickled (to the persistent
    worker), only these travel: the copy job and the budget hold stay with the trainer.
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

    def release_buffers(self) -> None:
        """Trainer: the writer is done with the staged bytes."""
        self.buffer = None  # a segment of this save alone is freed here


def _storage_copy(entry: _SavedStorage, buffer: torch.Tensor, offset: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(source, target)``: one storage's bytes and their place in ``buffer`` at ``offset``,
    viewed in the widest elements the size allows (trainer).

    A byte-wise copy of a large storage has 8x the elements, which torch splits over its
    thread pool much sooner (slow when busy)."""
    storage = entry.storage
    source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    target = buffer[offset : offset + entry.num_bytes]
    for dtype in (torch.int64, torch.int32, torch.int16):
        if entry.num_bytes % dtype.itemsize == 0 and source.data_ptr() % dtype.itemsize == 0:
            return source.view(dtype), target.view(dtype)
    return source, target


def _storage_alignment() -> int:
    """The record alignment ``torch.save`` uses now (``torch.utils.serialization.config``)."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: the fixed alignment of its writer
        return 64
    return int(config.save.storage_alignment)


def _tensor_names(obj: Any, prefix: str = "") -> Dict[int, str]:
    """``storage id -> path`` of the tensors in ``obj``'s dicts, lists and tuples (for messages)."""
    names: Dict[int, str] = {}
    if isinstance(obj, torch.Tensor):
        try:
            names[obj.untyped_storage()._cdata] = prefix or "<object>"
        except (RuntimeError, NotImplementedError):
            pass
    elif isinstance(obj, dict):
        for key, value in obj.items():
            for cdata, name in _tensor_names(value, f"{prefix}.{key}" if prefix else str(key)).items():
                names.setdefault(cdata, name)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            for cdata, name in _tensor_names(value, f"{prefix}[{i}]").items():
                names.setdefault(cdata, name)
    return names


def stage_torch_save(
    obj: Any,
    pickle_module: Any,
    pickle_protocol: int,
    byteorder_record: bool,
    limit: Any,
    timeout_s: float,
    stats: dict,
) -> TorchSaveStaged:
    """Pickle ``obj`` and stage its storages within the budget (trainer, ``preload_fn``).

    ``stats`` receives ``rounds`` and ``peak_bytes`` (the staging bytes held) of this save.

    Raises:
        StagingMemoryError: one storage alone exceeds the budget (naming its tensor and
            the budget it needs), or earlier saves did not free the memory within
            ``timeout_s``; nothing was staged and the trainer's state is untouched.
    """
    data, storages = pickle_like_torch_save(obj, pickle_module, pickle_protocol)
    sizes = [entry.num_bytes for entry in storages]
    state_bytes = sum(shared_memory.aligned(size) for size in sizes)
    budget = resolve_budget(limit, state_bytes)
    by_storage = _tensor_names(obj) if state_bytes > budget else {}
    names = [by_storage.get(e.storage._cdata, f"data/{e.key}") for e in storages]
    plan = plan_rounds(sizes, names, state_bytes if state_bytes <= budget else budget)
    in_rounds = plan.rounds > 1
    cuda = any(entry.storage.device.type == "cuda" for entry in storages)
    alignment = _storage_alignment()
    header = [("data.pkl", data), (".format_version", _FORMAT_VERSION),
              (".storage_alignment", str(alignment).encode())]
    if byteorder_record:
        header.append(("byteorder", sys.byteorder.encode()))
    records = [(f"data/{e.key}", offset, e.num_bytes) for e, offset in zip(storages, plan.offsets)]
    gate = StagingGate(len(storages))

    def stage_into(pool: Optional[torch.Tensor]) -> TorchSaveStaged:
        buffer = pool
        if in_rounds:
            gate.start_rounds()
        elif plan.pool_bytes:
            buffer = shared_memory.allocate_segment(plan.pool_bytes)
            if cuda:
                shared_memory.pin_segment(buffer)
        staged = TorchSaveStaged(header, records, buffer, gate, alignment,
                                 torch.serialization.get_crc32_options())
        items = [
            (idx, name, *_storage_copy(entry, buffer, offset), watch(*entry.tensors))
            for idx, (entry, offset, name) in enumerate(zip(storages, plan.offsets, names))
            if offset is not None
        ]
        staged.copy_job = copy_first_round(gate, plan, items, buffer, False, timeout_s,
                                           "torch.save staging in rounds", _ADVICE)
        return staged

    staged = StagingLedger.of_process().stage_within(
        stage_into, state_bytes=state_bytes, budget=budget, in_rounds=in_rounds, gate=gate,
        pinned=cuda, timeout_s=timeout_s,
    )
    stats.update(rounds=plan.rounds, peak_bytes=plan.pool_bytes)
    if in_rounds:
        logger.info(
            "torch.save staging: %d bytes of storages in %d rounds through a %d-byte pool "
            "(staging_memory_limit %d bytes)", state_bytes, plan.rounds, plan.pool_bytes, budget,
        )
    return staged
