"""Test aids for local checkpoint parts: write a part from buffers (as the background
writer writes one, and recovery writes a received one back), and read one back verified."""

import os
from typing import Any, Iterable, Optional

from megatron_async.local.part_output import open_part
from megatron_async.local.parts import LocalIdentity, PartRecord, part_name, verify_part


def write_part(
    directory, iteration: int, owner: int, buffers: Iterable[Any], identity: LocalIdentity,
    *, expected_digest: Optional[str] = None, replication: Any = None,
) -> PartRecord:
    """Write a part from ``buffers`` (bytes-like, one after the other) through
    :func:`~megatron_async.local.part_output.open_part`, replicated with ``replication``;
    with ``expected_digest``, as a replica that must hash to it."""
    with open_part(directory, iteration, owner, identity, replication=replication) as stream:
        stream.expected_digest = expected_digest
        for buffer in buffers:
            stream.append(buffer)
    return stream.record


def read_verified(directory, record: PartRecord) -> Optional[bytes]:
    """The part's bytes if they hash to its record's digest, else None."""
    if verify_part(directory, record) is None:
        return None
    with open(os.path.join(os.fspath(directory), part_name(record.iteration, record.owner)), "rb") as f:
        return f.read()
