"""Writing a staged ``torch.save`` file record by record: :func:`write_torch_save_file`.

Runs in the background writer of :class:`~megatron_async.torch_ckpt.TorchAsyncCheckpoint`:
the staged records (:mod:`megatron_async.staging.torch_save`) through ``torch.save``'s own
zip writer.
"""

from __future__ import annotations

import contextlib
import time
from typing import BinaryIO

import torch

from megatron_async.core.shared_memory import segment_view
from megatron_async.core.config import STAGING_WAIT_S
from megatron_async.staging.gate import wait_on_gate
from megatron_async.staging.torch_save import TorchSaveStaged
from megatron_async.storage.local import atomic_output

__all__ = ["write_torch_save_file", "write_torch_save_records"]


def write_torch_save_file(
    path: str, staged: TorchSaveStaged, timeout_s: float = STAGING_WAIT_S
) -> None:
    """Write ``staged`` to ``path`` atomically (background writer).

    A reader sees the previous file or the complete new one; on failure the temporary
    file is removed. The staging memory is given back (the gate marked done) as
    soon as the last record is written, before the fsync, or when the write fails.

    Raises:
        StagingRaceError: the trainer's copy failed (a tensor changed before its copy).
        AsyncTimeoutError: the trainer did not stage the next round within ``timeout_s``.
    """
    try:
        with atomic_output(path) as stream:
            write_torch_save_records(stream, staged, timeout_s)
            staged.gate.mark_done()
    finally:
        staged.gate.mark_done()


def write_torch_save_records(stream: BinaryIO, staged: TorchSaveStaged, timeout_s: float) -> None:
    """Write the zip archive of ``staged`` to ``stream`` (background writer)."""
    gate = staged.gate
    if gate.in_rounds:
        gate.record_writer()  # the trainer's copy waits end if this process dies
    archive = torch._C.PyTorchFileWriter(stream, staged.crc32, staged.alignment)
    try:
        for name, data in staged.header:
            archive.write_record(name, data, len(data))
        for idx, (name, offset, num_bytes) in enumerate(staged.records):
            if gate.in_rounds:
                wait_on_gate(
                    lambda: gate.is_staged(idx), gate, time.monotonic() + timeout_s,
                    f"the trainer staged nothing more for {timeout_s:.0f}s before {name}; "
                    "it is stuck",
                )
            if num_bytes:  # a storage of exactly the record's bytes, in the staging memory
                record = segment_view(staged.buffer, offset, (num_bytes,), torch.uint8)
                archive.write_record(name, record.untyped_storage(), num_bytes)
            else:
                archive.write_record(name, b"", 0)
            gate.mark_written(idx)
    except BaseException:
        # Finish the archive while the stream is open: an unfinished writer finishes it
        # in its destructor, and writing to the stream the caller closed (and removed)
        # by then ends the whole process (std::terminate). It is marked finished even
        # when this raises, so the destructor writes nothing.
        with contextlib.suppress(Exception):
            archive.write_end_of_file()
        raise
    archive.write_end_of_file()
