"""The ``torch.save`` archive of one plain CPU tensor, written around the tensor's own memory.

PyTorch DCP's ``torch_save`` layout stores every tensor item as a complete ``torch.save``
archive: a zip file holding the pickled tensor, a few small records, the tensor's bytes
and a central directory. Everything in it except the tensor's bytes depends only on the
dtype and shape, so the background writer takes those bytes (the *frame*: a head before
the data and a tail after it) once per dtype and shape, and writes head, the tensor's own
memory and tail. Calling ``torch.save`` per item instead costs about forty small writes,
a pickling and a CRC-32 pass over the data for every item, which is what limited the
writer with many tensors.

The frame comes from ``torch.save`` itself: under ``torch.serialization.skip_data`` (a
thread-local switch, so it is safe in a trainer process too) ``torch.save`` writes every
record but seeks over the storage's bytes, and the frame is what it wrote before and
after that seek. With CRC-32 off (``torch.serialization.set_crc32_options(False)``) the
archive is byte-identical to ``torch.save``'s; with it on (the default), the data
record's CRC-32 field is zero, since ``torch.save`` never saw the data (and the
serialization id, derived from the CRCs, differs): ``torch.load`` (and so DCP's and megatron-core's loaders) does not check it, while
Python's ``zipfile`` would. Every item's stored bytes are covered by the xxh3 checksums
of :mod:`megatron_async.integrity.checksums` instead.

The first frame of a process is checked: a probe tensor written this way must have
``torch.save``'s length and load back equal. If it does not (a PyTorch whose
``skip_data`` works otherwise), every item of this process goes through ``torch.save``.

The trainer fills the frame cache when it prepares a save's write (:func:`cache_frames`),
before any fork, so a forked writer inherits the frames instead of building them; the
persistent worker keeps the frames it built across saves. The cache takes no lock of its
own, so a fork never leaves a child a lock held by another thread of its parent.

Runs in the background writer (any thread) and, for :func:`cache_frames`, in the trainer.
"""

from __future__ import annotations

import ctypes
import functools
import io
import logging
from typing import Any, Iterable, Optional, Tuple

import torch

__all__ = ["cache_frames", "tensor_frame", "tensor_bytes"]

logger = logging.getLogger(__name__)

_MAX_CACHED_FRAMES = 4096


class _FrameCapture(io.RawIOBase):
    """The stream ``torch.save`` writes to under ``skip_data``: the bytes before its seek
    over the data are the head, those after it the tail."""

    def __init__(self) -> None:
        super().__init__()
        self.head = bytearray()
        self.tail = bytearray()
        self.skipped = 0
        self._position = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        (self.tail if self.skipped else self.head).extend(data)
        self._position += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: 0, io.SEEK_CUR: self._position}.get(whence)
        if target is None or target + offset < self._position or self.skipped:
            raise io.UnsupportedOperation("only one forward seek over the data")
        self.skipped = target + offset - self._position
        self._position += self.skipped
        return self._position

    def tell(self) -> int:
        return self._position


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


def _build_frame(dtype: torch.dtype, shape: torch.Size) -> Tuple[bytes, bytes]:
    """Return the archive bytes before and after the data of a tensor of ``dtype`` and ``shape``.

    ``torch.empty`` does not touch the memory it allocates, and ``skip_data`` does not read it.
    """
    capture = _FrameCapture()
    with torch.serialization.skip_data():
        torch.save(torch.empty(shape, dtype=dtype), capture)
    expected = shape.numel() * dtype.itemsize
    if capture.skipped != expected:
        raise ValueError(f"torch.save skipped {capture.skipped} bytes of data, not {expected}")
    return bytes(capture.head), bytes(capture.tail)


@functools.lru_cache(maxsize=None)
def _frames_usable() -> bool:
    """Whether a framed probe tensor is what ``torch.save`` writes, as far as a loader sees
    (checked once per process; a second thread may check it too: the same)."""
    probe = torch.arange(24, dtype=torch.float32)
    saved = io.BytesIO()
    try:
        torch.save(probe, saved)
        head, tail = _build_frame(probe.dtype, probe.shape)
        framed = head + tensor_bytes(probe).tobytes() + tail
        loaded = torch.load(io.BytesIO(framed), weights_only=True)
        usable, problem = len(framed) == len(saved.getvalue()) and torch.equal(loaded, probe), ""
    except Exception as exc:  # an unexpected torch.save: use torch.save itself
        usable, problem = False, f" ({exc!r})"
    if not usable:
        logger.warning(
            "framing tensors with torch.save's skip_data does not reproduce torch.save%s "
            "(torch %s); checkpoint items are written with torch.save, which is slower",
            problem,
            torch.__version__,
        )
    return usable


@functools.lru_cache(maxsize=_MAX_CACHED_FRAMES)
def _frame(dtype: torch.dtype, shape: torch.Size) -> Optional[Tuple[bytes, bytes]]:
    """The frame shared by every plain tensor of ``dtype`` and ``shape``, or None.

    Raises when the frame cannot be made now (e.g. no memory for the ``torch.empty``); a
    failure is not cached, so a later save tries again.
    """
    # An empty record is laid out differently; empty tensors are rare and cheap to save,
    # so torch.save writes them.
    if shape.numel() == 0 or not _frames_usable():
        return None
    return _build_frame(dtype, shape)


def _frame_or_none(dtype: torch.dtype, shape: torch.Size) -> Optional[Tuple[bytes, bytes]]:
    try:
        return _frame(dtype, shape)
    except Exception as exc:  # this shape only: torch.save writes the item
        logger.debug("no frame for %s %s: %r", dtype, tuple(shape), exc)
        return None


def tensor_frame(tensor: torch.Tensor) -> Optional[Tuple[bytes, bytes]]:
    """Return ``(head, tail)``: ``head + tensor's bytes + tail`` is its ``torch.save`` archive.

    The archive is what ``torch.save(tensor.clone())`` writes (with CRC-32 off, byte for
    byte). Returns None when the tensor needs ``torch.save`` itself: not a plain
    contiguous CPU tensor (see :func:`_is_plain`), empty, or a PyTorch whose frames do not
    reproduce ``torch.save``.
    """
    return _frame_or_none(tensor.dtype, tensor.shape) if _is_plain(tensor) else None


def cache_frames(data: Iterable[Any]) -> None:
    """Make the frames of a save's tensors (trainer, when it prepares the write).

    A tensor is staged as a fresh CPU tensor of its dtype and shape, so its frame is
    known before staging, whatever its device. Other items are skipped.
    """
    for value in data:
        if isinstance(value, torch.Tensor):
            _frame_or_none(value.dtype, value.shape)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's elements, without a copy.

    The view does not keep the tensor alive: the caller must hold the tensor while using it.
    """
    num_bytes = tensor.nbytes
    if num_bytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * num_bytes).from_address(tensor.data_ptr())).cast("B")
