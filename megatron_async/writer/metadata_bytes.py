"""The bytes of ``.metadata`` made once and reused by later saves of the same structure.

Runs on the coordinator rank, in a save's finalization. Two saves of one structure write
``.metadata`` pickles that differ only in ``storage_meta``: its ``checkpoint_id`` (the
directory) and ``save_id`` (the writer's uuid). A :class:`MetadataTemplate` is the pickle
of a save's metadata whose two varying strings are unique markers; :meth:`~MetadataTemplate.render`
replaces the markers by a new save's values without pickling again, so a warm save's
commit costs one copy of the bytes instead of a walk over every item.

The result stays a plain pickle of DCP's ``Metadata`` (stock ``torch.distributed.checkpoint``
and megatron-core load it without this package): the markers are plain string opcodes, and
a string opcode is replaced by the same opcode family for the new value. Protocol 4+
pickles are cut into frames (``FRAME`` + 8-byte length); the frame that holds a marker gets
its length corrected. Memo indices do not change, since only the strings' payloads do.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import struct
import uuid
from typing import Any, Dict, List, Optional, Tuple, Union

from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["MetadataTemplate", "metadata_pickle"]

PICKLE_PROTOCOL = pickle.DEFAULT_PROTOCOL
"""The protocol DCP's own writer uses (``pickle.dump`` without one)."""

_FRAME = pickle.FRAME[0]
_LARGE_PAYLOADS = {  # opcodes a protocol-4 pickler may write between frames: length width
    pickle.BINUNICODE[0]: 4, pickle.BINBYTES[0]: 4, pickle.BINUNICODE8[0]: 8,
    pickle.BINBYTES8[0]: 8, pickle.BYTEARRAY8[0]: 8,
}
_MAX_VALUE_BYTES = 1 << 16
"""Values longer than this are pickled afresh (a protocol-4 pickler would put them outside
a frame; no checkpoint path is that long)."""

_FIELDS = ("checkpoint_id", "save_id")
"""The fields of ``storage_meta`` that change from save to save."""


def _encode_str(value: str, protocol: int) -> bytes:
    """The opcode a pickler of ``protocol`` writes for the string ``value`` (without memo)."""
    data = value.encode("utf-8", "surrogatepass")
    if protocol >= 4 and len(data) < 256:
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _frame_headers(data: bytes) -> Optional[List[Tuple[int, int]]]:
    """``(header position, frame length)`` of every frame of a protocol-4+ pickle, or None
    when the stream holds something between frames that is not a large payload."""
    frames, pos = [], 2  # after PROTO n
    end = len(data)
    while pos < end:
        op = data[pos]
        if op == _FRAME:
            length = int.from_bytes(data[pos + 1:pos + 9], "little")
            frames.append((pos, length))
            pos += 9 + length
        elif op in _LARGE_PAYLOADS:
            width = _LARGE_PAYLOADS[op]
            pos += 1 + width + int.from_bytes(data[pos + 1:pos + 1 + width], "little")
        elif op == pickle.STOP[0] and pos == end - 1:
            pos += 1
        else:
            return None
    return frames


@dataclasses.dataclass(frozen=True)
class MetadataTemplate:
    """A metadata pickle whose ``storage_meta`` strings are replaced per save (coordinator).

    Build it with :meth:`build`; :meth:`render` gives the bytes of the same metadata with
    another ``storage_meta``.
    """

    data: bytes
    protocol: int
    edits: Tuple[Tuple[int, int, Optional[int]], ...]
    """``(position, length, frame header position or None)`` of each marker, in field
    order (``checkpoint_id``, ``save_id``)."""

    @classmethod
    def build(cls, metadata: Metadata, protocol: int = PICKLE_PROTOCOL) -> Optional["MetadataTemplate"]:
        """Pickle ``metadata`` with markers in ``storage_meta``; None where that cannot work
        (no ``storage_meta``, a non-string field, a marker found twice)."""
        meta = getattr(metadata, "storage_meta", None)
        if meta is None or not all(isinstance(getattr(meta, f, None), str) for f in _FIELDS):
            return None
        markers = [f"megatron_async-{field}-{uuid.uuid4().hex}" for field in _FIELDS]
        marked = copy.copy(metadata)  # keeps attributes that are not dataclass fields
        marked.storage_meta = copy.copy(meta)
        for field, marker in zip(_FIELDS, markers):
            setattr(marked.storage_meta, field, marker)
        data = pickle.dumps(marked, protocol=protocol)
        frames = _frame_headers(data) if protocol >= 4 else []
        if frames is None:
            return None
        edits = []
        for marker in markers:
            encoded = _encode_str(marker, protocol)
            position = data.find(encoded)
            if position < 0 or data.find(encoded, position + 1) >= 0:
                return None
            header = None
            for start, length in frames:
                if start < position and position + len(encoded) <= start + 9 + length:
                    header = start
            if protocol >= 4 and header is None:
                return None
            edits.append((position, len(encoded), header))
        if edits[0][0] > edits[1][0]:
            return None  # the fields pickle in declaration order; anything else is unknown
        return cls(data, protocol, tuple(edits))

    def render(self, storage_meta: Any) -> Optional[bytes]:
        """The pickle with ``storage_meta``'s values in place of the markers, or None when a
        value is not a short string (then pickle afresh)."""
        pieces = self.render_pieces(storage_meta)
        return None if pieces is None else b"".join(pieces)

    def render_pieces(self, storage_meta: Any) -> Optional[List[Union[bytes, memoryview]]]:
        """:meth:`render` as pieces to write one after the other: views of the template
        around the new strings, so that no copy of the whole pickle is made."""
        values = [getattr(storage_meta, field, None) for field in _FIELDS]
        if not all(isinstance(v, str) and len(v) < _MAX_VALUE_BYTES for v in values):
            return None
        replacements = [_encode_str(v, self.protocol) for v in values]
        growth: Dict[int, int] = {}
        for (_, length, header), new in zip(self.edits, replacements):
            if header is not None:
                growth[header] = growth.get(header, 0) + len(new) - length
        cuts = sorted(
            [(pos, length, new) for (pos, length, _), new in zip(self.edits, replacements)]
            + [(header, 9, self._frame(header, delta)) for header, delta in growth.items()]
        )
        view = memoryview(self.data)
        pieces: List[Union[bytes, memoryview]] = []
        cursor = 0
        for pos, length, new in cuts:
            pieces += [view[cursor:pos], new]
            cursor = pos + length
        pieces.append(view[cursor:])
        return pieces

    def _frame(self, header: int, delta: int) -> bytes:
        length = int.from_bytes(self.data[header + 1:header + 9], "little") + delta
        return pickle.FRAME + length.to_bytes(8, "little")


def metadata_pickle(metadata: Metadata) -> Tuple[bytes, Optional[MetadataTemplate]]:
    """The ``.metadata`` bytes of ``metadata``, and the template that renders them again
    for a later save of the same structure (None when no template can be made)."""
    template = MetadataTemplate.build(metadata)
    if template is not None:
        data = template.render(metadata.storage_meta)
        if data is not None:
            return data, template
    return pickle.dumps(metadata, protocol=PICKLE_PROTOCOL), None
