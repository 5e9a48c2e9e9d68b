"""The ``torch.save`` archive of one plain CPU tensor, built without calling ``torch.save``.

PyTorch DCP's ``torch_save`` layout stores every tensor item as a complete ``torch.save``
archive: a zip file holding the pickled tensor, a few small records, the tensor's bytes
and a central directory. Everything in it except the tensor's bytes depends only on the
dtype and shape, so the background writer builds those bytes (the *frame*: a head before
the data and a tail after it) once per dtype and shape, and writes head, the tensor's own
memory and tail. Calling ``torch.save`` per item instead costs about forty small writes,
a pickling and a CRC-32 pass over the data for every item, which is what limited the
writer with many tensors.

The CRC-32 fields are written as zero, exactly what ``torch.save`` writes after
``torch.serialization.set_crc32_options(False)``, without touching that process-wide
setting. ``torch.load`` does not check them; our xxh3 checksums cover every item instead
(see "Known limits" in docs/failures.md).

The small records (format version, storage alignment, byte order, archive version,
serialization id) are copied from a ``torch.save`` of a probe tensor the first time a
frame is needed in a process, and the frame built for that probe must reproduce the
probe's real ``torch.save`` output byte for byte (CRC fields set to zero). If it does not,
e.g. a later PyTorch lays the archive out differently, every item of this process goes
through ``torch.save``.

Runs in the background writer (any thread; the frame cache is shared).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import io
import logging
import pickle
import struct
from typing import List, Optional, Tuple

import torch

__all__ = ["tensor_frame", "tensor_bytes"]

logger = logging.getLogger(__name__)

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL_ENTRY = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_LOCAL_HEADER_SIG = 0x04034B50
_DESCRIPTOR_SIG = 0x08074B50
_CENTRAL_ENTRY_SIG = 0x02014B50
_ZIP64_END_SIG = 0x06064B50
_ZIP64_LOCATOR_SIG = 0x07064B50
_END_SIG = 0x06054B50
# Sizes and CRC follow the data in a descriptor (bit 3); names are UTF-8 (bit 11).
_FLAGS = 0x0808
_ZIP64_MADE_BY, _ZIP64_NEEDED = 0x031E, 45
# Each record's data starts on an alignment boundary: a padding extra field ("FB",
# 16-bit size, "Z" bytes) after the name makes it so.
_PADDING_ID = b"FB"

MAX_DATA_BYTES = 0xFFFFFFFF - (1 << 20)
"""Larger tensors need zip64 fields in every record; they go through ``torch.save``."""

_MAX_CACHED_FRAMES = 4096

_DATA_PKL = "data.pkl"
_DATA_RECORD = "data/0"


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a single-tensor ``torch.save`` archive holds besides the pickle and the data."""

    prefix: str
    """The archive folder every record name starts with (``archive/``)."""
    before_data: Tuple[Tuple[bytes, bytes], ...]
    """``(name, content)`` of the records between the pickle and the data, in order."""
    after_data: Tuple[Tuple[bytes, bytes], ...]
    """``(name, content)`` of the records after the data, in order."""
    alignment: int
    """Every record's data starts at a multiple of this offset."""


class _TensorPickler(pickle.Pickler):
    """Pickles one tensor the way ``torch.save`` does: its storage becomes record ``data/0``."""

    def __init__(self, file: io.BytesIO, numel: int):
        super().__init__(file, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self._numel = numel

    def persistent_id(self, obj):
        if isinstance(obj, torch.storage.TypedStorage):
            # The legacy class name (FloatStorage, ...), as torch.save records it.
            storage_type = getattr(torch, obj._pickle_storage_type())
            return ("storage", storage_type, "0", "cpu", self._numel)
        if isinstance(obj, torch.UntypedStorage):
            return ("storage", torch.UntypedStorage, "0", "cpu", obj.nbytes())
        return None


def _pickle_tensor(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    _TensorPickler(buffer, tensor.numel()).dump(tensor)
    return buffer.getvalue()


def _is_plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is saved like a fresh tensor of its dtype and shape.

    That is a plain, dense, contiguous CPU tensor that carries nothing else (no autograd,
    no conjugate or negative bit, no Python attributes). It may be a view into a larger
    storage: it is then saved as its own bytes, as ``torch.save(tensor.clone())`` would
    (DCP's own writer clones such tensors for the same reason), not with the whole
    storage as ``torch.save(tensor)`` would.
    """
    return (
        type(tensor) is torch.Tensor
        and tensor.is_cpu
        and tensor.layout is torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_nested
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.is_contiguous()
        and not tensor.__dict__
    )


def _build_frame(layout: _Layout, pickled: bytes, num_bytes: int) -> Tuple[bytes, bytes]:
    """Return the archive bytes before and after ``num_bytes`` of tensor data."""
    records: List[Tuple[bytes, Optional[bytes]]] = [
        ((layout.prefix + _DATA_PKL).encode(), pickled),
        *layout.before_data,
        ((layout.prefix + _DATA_RECORD).encode(), None),
        *layout.after_data,
    ]
    parts = [bytearray()]
    position = 0
    central: List[Tuple[bytes, int, int]] = []

    def emit(data: bytes) -> None:
        nonlocal position
        parts[-1] += data
        position += len(data)

    for name, content in records:
        size = num_bytes if content is None else len(content)
        header_offset = position
        padding = -(position + _LOCAL_HEADER.size + len(name) + 4) % layout.alignment
        emit(
            _LOCAL_HEADER.pack(
                _LOCAL_HEADER_SIG, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(name), 4 + padding
            )
        )
        emit(name)
        emit(_PADDING_ID + struct.pack("<H", padding) + b"Z" * padding)
        if content is None:
            parts.append(bytearray())
            position += num_bytes
        else:
            emit(content)
        emit(_DESCRIPTOR.pack(_DESCRIPTOR_SIG, 0, size, size))
        central.append((name, size, header_offset))

    directory_offset = position
    for name, size, header_offset in central:
        emit(
            _CENTRAL_ENTRY.pack(
                _CENTRAL_ENTRY_SIG, 0, 0, _FLAGS, 0, 0, 0, 0, size, size, len(name), 0, 0, 0, 0, 0,
                header_offset,
            )
        )
        emit(name)
    directory_size = position - directory_offset
    zip64_end_offset = position
    count = len(central)
    emit(
        _ZIP64_END.pack(
            _ZIP64_END_SIG, _ZIP64_END.size - 12, _ZIP64_MADE_BY, _ZIP64_NEEDED, 0, 0, count, count,
            directory_size, directory_offset,
        )
    )
    emit(_ZIP64_LOCATOR.pack(_ZIP64_LOCATOR_SIG, 0, zip64_end_offset, 1))
    emit(_END.pack(_END_SIG, 0, 0, count, count, directory_size, directory_offset, 0))
    head, tail = parts
    return bytes(head), bytes(tail)


def _read_records(archive: bytes) -> Tuple[List[Tuple[bytes, int, int]], List[int]]:
    """Parse a small zip archive.

    Returns:
        ``(name, data offset, size)`` of every record in directory order, and the offsets
        of every CRC-32 field (data descriptors and central directory entries).
    """
    fields = _END.unpack_from(archive, len(archive) - _END.size)
    count, directory_offset = fields[3], fields[6]
    records, crc_fields = [], []
    position = directory_offset
    for _ in range(count):
        entry = _CENTRAL_ENTRY.unpack_from(archive, position)
        size, name_len, extra_len, comment_len, header_offset = (
            entry[8], entry[10], entry[11], entry[12], entry[16],
        )
        name = archive[position + _CENTRAL_ENTRY.size : position + _CENTRAL_ENTRY.size + name_len]
        crc_fields.append(position + 16)
        position += _CENTRAL_ENTRY.size + name_len + extra_len + comment_len
        local = _LOCAL_HEADER.unpack_from(archive, header_offset)
        data_offset = header_offset + _LOCAL_HEADER.size + local[9] + local[10]
        crc_fields.append(data_offset + size + 4)
        records.append((name, data_offset, size))
    return records, crc_fields


def _probe_layout() -> Optional[_Layout]:
    """Learn the archive layout from ``torch.save`` and check that it is reproduced exactly."""
    probe = torch.arange(24, dtype=torch.float32)
    saved = io.BytesIO()
    torch.save(probe, saved)
    archive = saved.getvalue()
    records, crc_fields = _read_records(archive)
    names = [name.decode() for name, _, _ in records]
    if not names or not names[0].endswith(_DATA_PKL):
        return None
    prefix = names[0][: -len(_DATA_PKL)]
    data_name = prefix + _DATA_RECORD
    if names.count(data_name) != 1:
        return None
    split = names.index(data_name)
    contents = [(name, archive[start : start + size]) for name, start, size in records]
    alignment = 64
    for name, content in contents:
        if name.decode() == prefix + ".storage_alignment":
            alignment = int(content)
    layout = _Layout(prefix, tuple(contents[1:split]), tuple(contents[split + 1 :]), alignment)

    expected = bytearray(archive)
    for offset in crc_fields:
        expected[offset : offset + 4] = bytes(4)
    head, tail = _build_frame(layout, _pickle_tensor(probe), probe.numel() * probe.element_size())
    if head + tensor_bytes(probe).tobytes() + tail != expected:
        return None
    return layout


@functools.lru_cache(maxsize=None)
def _get_layout() -> Optional[_Layout]:
    """The layout learnt once per process (a second thread may learn it too: the same)."""
    problem = "is not the expected one"
    try:
        layout = _probe_layout()
    except Exception as exc:  # an unexpected torch.save output: use torch.save itself
        layout, problem = None, f"could not be read ({exc!r})"
    if layout is None:
        logger.warning(
            "torch.save's archive layout %s (torch %s); checkpoint items are "
            "written with torch.save, which is slower",
            problem,
            torch.__version__,
        )
    return layout


def tensor_frame(tensor: torch.Tensor) -> Optional[Tuple[bytes, bytes]]:
    """Return ``(head, tail)``: ``head + tensor's bytes + tail`` is its ``torch.save`` archive.

    The archive is what ``torch.save(tensor.clone())`` writes with CRC-32 computation
    switched off. Returns None when the tensor needs ``torch.save`` itself: not a plain
    contiguous CPU tensor (see :func:`_is_plain`), empty, larger than
    :data:`MAX_DATA_BYTES`, or a PyTorch whose archive layout this module does not
    reproduce.
    """
    return _frame(tensor.dtype, tensor.shape) if _is_plain(tensor) else None


@functools.lru_cache(maxsize=_MAX_CACHED_FRAMES)
def _frame(dtype: torch.dtype, shape: torch.Size) -> Optional[Tuple[bytes, bytes]]:
    """The frame shared by every plain tensor of ``dtype`` and ``shape``, or None."""
    num_bytes = shape.numel() * dtype.itemsize
    layout = _get_layout()
    # An empty record is laid out differently (no data descriptor); empty tensors are
    # rare and cheap to save, so torch.save writes them.
    if layout is None or num_bytes == 0 or num_bytes > MAX_DATA_BYTES:
        return None
    # The pickle of a fresh tensor (own storage, offset 0, contiguous strides). torch.empty
    # does not touch the memory it allocates.
    return _build_frame(layout, _pickle_tensor(torch.empty(shape, dtype=dtype)), num_bytes)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's elements, without a copy.

    The view does not keep the tensor alive: the caller must hold the tensor while using it.
    """
    num_bytes = tensor.nbytes
    if num_bytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * num_bytes).from_address(tensor.data_ptr())).cast("B")
