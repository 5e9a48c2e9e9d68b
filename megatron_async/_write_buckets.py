"""Write buckets: how one rank's checkpoint items become files, and how a file is written.

A *bucket* is the content of one ``.distcp`` file: the resolved data of some write items
of this rank. Buckets are planned in the trainer on every rank (``prepare_write_data``),
staged to host memory where the preload function runs (see :mod:`._staging`), and
written by the background writer, one bucket per thread or per process.

The background writer hands its results back through a :class:`ResultFile` rather than a
multiprocessing queue: a queue cannot be pickled into an already running (spawned)
persistent worker, and a pipe blocks the writer as soon as its results outgrow the pipe
buffer while the trainer is not reading yet. A small file works the same for a forked
child, the persistent worker and a synchronous call.
"""

from __future__ import annotations

import dataclasses
import heapq
import inspect
import io
import logging
import os
import pickle
import shutil
import tempfile
import threading
import uuid
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, TypeVar

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.checksums import HashingWriter
from megatron_async.errors import RankFailure

__all__ = [
    "WriteBucket",
    "WriteOutcome",
    "ResultFile",
    "item_num_bytes",
    "balance_by_size",
    "BucketLayout",
    "assign_buckets",
    "materialize_buckets",
    "write_bucket",
    "ChecksummedWriteResult",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

BytesData = List[Tuple[WriteItem, io.BytesIO]]
TensorData = List[Tuple[WriteItem, torch.Tensor]]


class WriteBucket(NamedTuple):
    """The content of one checkpoint file.

    Unpacks like megatron-core's ``(file_path, storage_key, (bytes_data, tensor_data))``
    tuple, so write functions of either library accept it.

    Attributes:
        file_path: absolute path of the file to write.
        file_name: the file's name relative to the checkpoint directory; it is the
            storage key that ``.metadata`` records for every item of the bucket.
        data: ``(bytes_data, tensor_data)``: lists of ``(write_item, data)`` pairs.
    """

    file_path: str
    file_name: str
    data: Tuple[BytesData, TensorData]


@dataclasses.dataclass
class WriteOutcome:
    """What a background writer reports for one save of one rank.

    Attributes:
        rank: the training rank the writer works for.
        results: bucket index -> the write results of that bucket's items.
        failures: bucket index -> what went wrong while writing that bucket.
    """

    rank: int
    results: Dict[int, List[WriteResult]] = dataclasses.field(default_factory=dict)
    failures: Dict[int, RankFailure] = dataclasses.field(default_factory=dict)


def item_num_bytes(item: WriteItem, data: Any = None) -> int:
    """Return the number of bytes ``item`` occupies: its chunk for tensors, its length for bytes."""
    if item.type == WriteItemType.BYTE_IO:
        return len(data.getbuffer()) if isinstance(data, io.BytesIO) else 0
    if item.tensor_data is None:
        return 0
    numel = 1
    for size in item.tensor_data.chunk.sizes:
        numel *= size
    return numel * torch._utils._element_size(item.tensor_data.properties.dtype)


def balance_by_size(sized: Sequence[Tuple[T, int]], bins: int) -> List[List[T]]:
    """Split ``(value, num_bytes)`` pairs into ``bins`` lists with sums as even as possible.

    Largest first, each into the currently lightest bin; ties go to the lower bin index,
    so the split is deterministic for a given input.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    buckets: List[List[T]] = [[] for _ in range(bins)]
    heap = [(0, idx) for idx in range(bins)]
    order = sorted(range(len(sized)), key=lambda i: (-sized[i][1], i))
    for i in order:
        total, idx = heapq.heappop(heap)
        buckets[idx].append(sized[i][0])
        heapq.heappush(heap, (total + sized[i][1], idx))
    return buckets


def _split_bins(thread_count: int, with_hint: bool) -> Tuple[int, int]:
    """Return ``(bins for other items, bins for hinted items)``."""
    if not with_hint:
        return thread_count, 0
    hinted = max(1, thread_count // 2)
    return max(1, thread_count - hinted), hinted


BucketLayout = List[Tuple[str, List[int]]]
"""Which items go to which file: ``(file name prefix, positions of the items)`` per bucket."""


def assign_buckets(
    resolved: Sequence[Tuple[WriteItem, Any]],
    thread_count: int,
    separation_hint: Optional[str] = None,
) -> BucketLayout:
    """Decide which items share a file: at most ``thread_count`` size-balanced buckets.

    Runs in the trainer on every rank. Items whose key starts with ``separation_hint``
    never share a file with other items and their file names start with the hint
    (megatron-core's convention, which its ``remove_sharded_tensors`` relies on). With a
    hint, a rank that has both kinds of items writes at least two files even when
    ``thread_count`` is 1.

    Args:
        resolved: ``(write_item, data)`` pairs, data being a tensor or ``io.BytesIO``.
        thread_count: the number of buckets to aim for.
        separation_hint: key prefix of items that go to separate files.

    Returns:
        The non-empty buckets as ``(file name prefix, item positions)``.
    """
    hinted, others = [], []
    for pos, (item, data) in enumerate(resolved):
        is_hinted = separation_hint is not None and item.index.fqn.startswith(separation_hint)
        (hinted if is_hinted else others).append((pos, item_num_bytes(item, data)))

    other_bins, hinted_bins = _split_bins(thread_count, bool(hinted) and bool(others))
    if not others:
        other_bins, hinted_bins = 0, thread_count
    layout: BucketLayout = []
    for name_prefix, sized, bins in (("", others, other_bins), (separation_hint, hinted, hinted_bins)):
        if sized and bins:
            layout += [(name_prefix or "", sorted(b)) for b in balance_by_size(sized, bins) if b]
    return layout


def materialize_buckets(
    resolved: Sequence[Tuple[WriteItem, Any]],
    layout: BucketLayout,
    checkpoint_dir: str,
    storage_prefix: str,
) -> List[WriteBucket]:
    """Build the buckets of ``layout``; file ``idx`` is ``{name prefix}{storage_prefix}{idx}.distcp``.

    Within a bucket, bytes items come first, then tensors in plan order.
    """
    buckets = []
    for idx, (name_prefix, positions) in enumerate(layout):
        file_name = f"{name_prefix}{storage_prefix}{idx}{DEFAULT_SUFFIX}"
        content = [resolved[pos] for pos in positions]
        bytes_data = [(i, d) for i, d in content if i.type == WriteItemType.BYTE_IO]
        tensor_data = [(i, d) for i, d in content if i.type != WriteItemType.BYTE_IO]
        buckets.append(
            WriteBucket(os.path.join(checkpoint_dir, file_name), file_name, (bytes_data, tensor_data))
        )
    return buckets


def _write_item_kwargs() -> Dict[str, Any]:
    params = inspect.signature(_write_item).parameters
    if "serialization_format" not in params:
        return {}
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    return {"serialization_format": SerializationFormat.TORCH_SAVE}


@dataclasses.dataclass(frozen=True)
class ChecksummedWriteResult(WriteResult):
    """A DCP ``WriteResult`` that also carries the xxh3 digest of the item's stored bytes."""

    checksum: Optional[str] = None


def write_bucket(
    transforms: Any, bucket: WriteBucket, use_fsync: bool, compute_checksums: bool = True
) -> List[WriteResult]:
    """Write one staged bucket to its file in DCP's byte layout and return its results.

    Runs in the background writer (a thread or a process). Every item is serialized with
    PyTorch DCP's own item writer, so any DCP reader can read the file. With
    ``compute_checksums`` every byte is hashed on its way to the file (no second read)
    and each result is a :class:`ChecksummedWriteResult`.

    Args:
        transforms: the writer's ``_StorageWriterTransforms`` (stream extensions).
        bucket: a staged bucket: every tensor must be on the CPU.
        use_fsync: flush the file to stable storage before returning.
        compute_checksums: record an xxh3 digest of every item.

    Raises:
        ValueError: a tensor is not on the CPU (the bucket was not staged).
        OSError: the file could not be written.
    """
    bytes_data, tensor_data = bucket.data
    extra = _write_item_kwargs()
    results: List[WriteResult] = []
    with open(bucket.file_path, "wb") as stream:
        target = HashingWriter(stream, hashing=compute_checksums)

        def write(item: WriteItem, data: Any) -> None:
            target.start_item()
            try:
                result = _write_item(transforms, target, data, item, bucket.file_name, **extra)
            except Exception as exc:
                if target.write_error is not None:  # the real cause, e.g. ENOSPC
                    raise target.write_error from exc
                raise
            if compute_checksums:
                result = ChecksummedWriteResult(
                    result.index, result.size_in_bytes, result.storage_data, target.finish_item()
                )
            results.append(result)

        for item, data in bytes_data:
            write(item, data)
        for item, tensor in tensor_data:
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"{item.index.fqn} is on {tensor.device}; run the request's preload_fn "
                    "(staging) before the save function"
                )
            write(item, tensor)
        if use_fsync:
            stream.flush()
            os.fsync(stream.fileno())
    return results


_results_dir_lock = threading.Lock()
_results_dir: Optional[str] = None


def _get_results_dir() -> str:
    """Return this process's private folder for result files, creating it on first use."""
    global _results_dir
    with _results_dir_lock:
        if _results_dir is None or not os.path.isdir(_results_dir):
            _results_dir = tempfile.mkdtemp(prefix=f"megatron_async_results_{os.getpid()}_")
            import atexit

            atexit.register(shutil.rmtree, _results_dir, True)
        return _results_dir


@dataclasses.dataclass(frozen=True)
class ResultFile:
    """A one-shot channel from a background writer to the trainer, through a small file.

    Created in the trainer; pickles as a path, so it reaches a forked child, a spawned
    persistent worker or the calling thread alike. The writer :meth:`put` s one object
    (written to a temporary name and renamed, so the reader never sees half a file); the
    trainer :meth:`take` s it once the background part is done.
    """

    path: str

    @classmethod
    def create(cls, tag: str) -> "ResultFile":
        """Return a fresh channel in this process's results folder (trainer side)."""
        return cls(os.path.join(_get_results_dir(), f"{tag}_{uuid.uuid4().hex}.pkl"))

    def derive(self, suffix: str) -> "ResultFile":
        """Return a sibling channel (for a sub-process of the writer)."""
        return ResultFile(f"{self.path}.{suffix}")

    def put(self, obj: Any) -> None:
        """Publish ``obj`` (background writer side)."""
        tmp_path = f"{self.path}.tmp{os.getpid()}"
        with open(tmp_path, "wb") as stream:
            pickle.dump(obj, stream)
        os.replace(tmp_path, self.path)

    def take(self) -> Any:
        """Return the published object and remove the file (trainer side).

        Raises:
            FileNotFoundError: nothing was published (the writer died or never ran).
        """
        with open(self.path, "rb") as stream:
            obj = pickle.load(stream)
        self.discard()
        return obj

    def discard(self) -> None:
        """Remove the file and any temporary leftovers; best effort."""
        folder, name = os.path.split(self.path)
        try:
            leftovers = [f for f in os.listdir(folder) if f.startswith(name)]
        except OSError:
            return
        for leftover in leftovers:
            try:
                os.remove(os.path.join(folder, leftover))
            except OSError as exc:
                logger.debug("could not remove result file %s: %s", leftover, exc)
