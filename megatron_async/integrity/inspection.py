"""Read a torch_dist checkpoint's metadata and check that it is complete.

Runs in a single process (a command-line tool or a test); nothing here needs
torch.distributed. A checkpoint is *complete* when megatron's ``metadata.json`` and
DCP's ``.metadata`` exist, every tensor chunk listed in the metadata has a storage
entry, and every storage entry lies inside an existing file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Dict, List, Optional

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from megatron_async.checkpoint_dirs import iteration_from_path
from megatron_async.format import DCP_METADATA_FILE, MEGATRON_METADATA_FILE, missing_completion_markers
from megatron_async.storage.backend import normalize_checkpoint_path, storage_for

__all__ = [
    "TensorEntry",
    "FileEntry",
    "CheckpointSummary",
    "find_completeness_problems",
    "summarize_checkpoint",
]


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of the checkpoint: global shape, dtype, bytes and number of chunks."""

    name: str
    global_shape: List[int]
    dtype: str
    num_bytes: int
    num_chunks: int


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One data file of the checkpoint directory and its size."""

    name: str
    num_bytes: int


@dataclasses.dataclass
class CheckpointSummary:
    """What ``inspect`` reports about one checkpoint directory."""

    path: str
    format: Optional[str]
    format_version: Optional[int]
    iteration: Optional[int]
    complete: bool
    problems: List[str]
    tensors: List[TensorEntry]
    objects: List[str]
    files: List[FileEntry]

    @property
    def total_bytes(self) -> int:
        return sum(entry.num_bytes for entry in self.files)

    def to_json(self) -> Dict:
        data = dataclasses.asdict(self)
        data["total_bytes"] = self.total_bytes
        return data


def find_completeness_problems(path: str, metadata: Optional[Metadata] = None) -> List[str]:
    """Every reason the checkpoint at ``path`` is not complete (see the module docstring);
    empty when it is."""
    storage = storage_for(path)
    if not storage.is_dir(path):
        return [f"{path} is not a directory"]
    missing = missing_completion_markers(path, storage)
    problems = [f"{name} is missing (the save never finalized)" for name in missing]
    if DCP_METADATA_FILE in missing:
        return problems
    if metadata is None:
        try:
            metadata = storage.dcp_reader(path).read_metadata()
        except Exception as exc:  # a damaged .metadata is a finding, not a crash
            return problems + [f"{DCP_METADATA_FILE} cannot be read: {exc}"]
    storage_data = metadata.storage_data or {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            for chunk in item.chunks:
                if MetadataIndex(fqn, chunk.offsets) not in storage_data:
                    problems.append(f"tensor {fqn} chunk at {list(chunk.offsets)} has no storage entry")
        elif MetadataIndex(fqn) not in storage_data:
            problems.append(f"object {fqn} has no storage entry")
    sizes = dict(storage.list_dir(path))  # None for a directory
    for index, info in storage_data.items():
        name = info.relative_path
        size = sizes.get(name)
        if size is None:
            problems.append(f"file {name} (holding {index.fqn}) is missing")
        elif info.offset + info.length > size:
            problems.append(
                f"file {name} is truncated: {index.fqn} needs bytes "
                f"{info.offset}..{info.offset + info.length} but the file has {size}"
            )
    return problems


def summarize_checkpoint(path: str) -> CheckpointSummary:
    """Read everything ``inspect`` shows about the checkpoint at ``path``."""
    storage = storage_for(path)
    try:
        config = json.loads(storage.read(os.path.join(path, MEGATRON_METADATA_FILE)))
    except FileNotFoundError:
        config = {}
    tensors: List[TensorEntry] = []
    objects: List[str] = []
    try:
        metadata = storage.dcp_reader(path).read_metadata()
    except Exception:  # missing or damaged: find_completeness_problems says which
        metadata = None
    if metadata is not None:
        for fqn, item in sorted(metadata.state_dict_metadata.items()):
            if isinstance(item, TensorStorageMetadata):
                tensors.append(
                    TensorEntry(
                        name=fqn,
                        global_shape=list(item.size),
                        dtype=str(item.properties.dtype).replace("torch.", ""),
                        num_bytes=math.prod(item.size) * item.properties.dtype.itemsize,
                        num_chunks=len(item.chunks),
                    )
                )
            elif isinstance(item, BytesStorageMetadata):
                objects.append(fqn)
    problems = find_completeness_problems(path, metadata)
    return CheckpointSummary(
        path=normalize_checkpoint_path(path),
        format=config.get("sharded_backend"),
        format_version=config.get("sharded_backend_version"),
        iteration=iteration_from_path(path),
        complete=not problems,
        problems=problems,
        tensors=tensors,
        objects=objects,
        files=[FileEntry(name, size) for name, size in storage.list_dir(path) if size is not None],
    )
