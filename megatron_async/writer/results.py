"""The channel through which a background writer reports one save's results.

The trainer creates a :class:`ResultFile`, the background writer fills it, and the
trainer reads it back with :func:`collect_write_results` in the save's finalization. A
file rather than a multiprocessing queue: a queue cannot be pickled into an already
running persistent worker, and a pipe blocks the writer as soon as its results outgrow
the pipe buffer while the trainer is not reading yet. :func:`collect_write_results` also
reads the queue of :func:`get_write_results_queue`, for code written against the
reference API.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import threading
import traceback
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.errors import (
    CheckpointIntegrityError,
    CheckpointValidationError,
    RankFailure,
    StorageWriteError,
    WorkerDiedError,
)
from megatron_async.buckets.layout import WriteBucket

__all__ = [
    "BucketResults",
    "WriteOutcome",
    "ResultFile",
    "WrappedException",
    "collect_write_results",
    "get_write_results_queue",
    "wrap_exception",
]

logger = logging.getLogger(__name__)


class BucketResults(dict):
    """What a successful background write reports: bucket index -> that bucket's results.

    A plain dict to code written against the reference API (``Dict[int,
    List[WriteResult]]``); ``elapsed_s`` adds how long the background write took.
    """

    elapsed_s: Optional[float] = None


@dataclasses.dataclass
class WriteOutcome:
    """What a background writer collects for one save of one rank (background side).

    Attributes:
        rank: the training rank the writer works for.
        checkpoint_dir: the directory written (for messages).
        results: bucket index -> the write results of that bucket's items.
        failures: bucket index -> what went wrong while writing that bucket.
        elapsed_s: how long writing every bucket took.
    """

    rank: int
    checkpoint_dir: str = ""
    results: Dict[int, List[WriteResult]] = dataclasses.field(default_factory=dict)
    failures: Dict[int, RankFailure] = dataclasses.field(default_factory=dict)
    elapsed_s: Optional[float] = None

    def payload(self) -> Union["BucketResults", StorageWriteError]:
        """What goes to the results channel: the results, or the error that says what failed.

        The error's message keeps megatron-core's wording ("Worker failure ..."), which log
        alerts and Megatron-LM's tests search for; its ``failure`` is the first failed
        bucket's record (with the original exception).
        """
        if self.failures:
            failures = [self.failures[idx] for idx in sorted(self.failures)]
            causes = "; ".join(f"[{f.phase}] {f.exception_type}: {f.message}" for f in failures)
            where = self.checkpoint_dir or "the checkpoint"
            return StorageWriteError(
                f"Worker failure on rank {self.rank}: writing {where} failed: {causes}",
                failures[0],
            )
        results = BucketResults(self.results)
        results.elapsed_s = self.elapsed_s
        return results


_results_dir_lock = threading.Lock()
_results_dir: Optional[str] = None


def _get_results_dir() -> str:
    """Return this process's private folder for result files, creating it on first use."""
    global _results_dir
    with _results_dir_lock:
        if _results_dir is None or not os.path.isdir(_results_dir):
            _results_dir = tempfile.mkdtemp(prefix=f"megatron_async_results_{os.getpid()}_")
            atexit.register(shutil.rmtree, _results_dir, True)
        return _results_dir


@dataclasses.dataclass(frozen=True)
class ResultFile:
    """A one-shot channel from a background writer to the trainer, through a small file.

    Pickles as a path, so it reaches a forked child, the persistent worker or the
    calling thread alike. The writer :meth:`put` s one object (written to a temporary
    name and renamed, so the reader never sees half a file); the trainer :meth:`get` s it
    once the background part is done, as from a queue.
    """

    path: str

    @classmethod
    def create(cls, tag: str) -> "ResultFile":
        """Return a fresh channel in this process's results folder (trainer side)."""
        return cls(os.path.join(_get_results_dir(), f"{tag}_{uuid.uuid4().hex}.pkl"))

    def put(self, obj: Any) -> None:
        """Publish ``obj`` (background writer side)."""
        tmp_path = f"{self.path}.tmp{os.getpid()}"
        with open(tmp_path, "wb") as stream:
            pickle.dump(obj, stream)
        os.replace(tmp_path, self.path)

    def get(self, timeout: Optional[float] = None) -> Any:
        """Return the published object and remove the file (trainer side); a queue's
        ``get``, except that it never waits (``timeout`` is ignored): the trainer reads
        once the background part is over.

        Raises:
            FileNotFoundError: nothing was published (the writer died or never ran).
        """
        try:
            with open(self.path, "rb") as stream:
                return pickle.load(stream)
        finally:  # best effort: a killed writer's temporary file goes with the folder at exit
            with contextlib.suppress(OSError):
                os.remove(self.path)


WrappedException = Tuple[BaseException, traceback.StackSummary]
"""PyTorch DCP's form of a failure that is returned rather than raised."""

_results_queue: Any = None
"""The process's queue of :func:`get_write_results_queue`, once created (as the reference's
module attribute ``_results_queue``)."""
_results_queue_lock = threading.Lock()


def get_write_results_queue(mp_mode: str = "spawn") -> Any:
    """Return this process's queue for write results, created on first use (trainer side).

    A multiprocessing manager's queue of the start method of the first call (``"spawn"``,
    ``"fork"`` or ``"forkserver"``): its handle pickles, so background processes of any
    kind can ``put`` into it. For code written against the reference API that passes its
    own ``global_results_queue`` to the write paths or sets a writer's ``results_queue``.

    Raises:
        CheckpointValidationError: an unknown start method.
    """
    global _results_queue
    if mp_mode not in mp.get_all_start_methods():
        raise CheckpointValidationError(
            f"mp_mode must be one of {mp.get_all_start_methods()}, got {mp_mode!r}"
        )
    with _results_queue_lock:
        if _results_queue is None:
            _results_queue = mp.get_context(mp_mode).Manager().Queue()
        return _results_queue


_RESULTS_QUEUE_WAIT_S = 5.0
"""How long :func:`collect_write_results` waits on a results queue for an outcome that the
finished background part must already have put (a manager queue delivers with a delay)."""


def wrap_exception(exc: BaseException) -> WrappedException:
    """DCP's wrapped form of ``exc``, with the traceback where it was first raised."""
    failure = getattr(exc, "failure", None)
    stack = getattr(failure, "stack", None) or traceback.extract_tb(exc.__traceback__)
    return exc, stack


def collect_write_results(
    channel: Any, write_buckets: Sequence[WriteBucket], checkpoint_dir: str, rank: int
) -> Union[Tuple[List[WriteResult], Optional[float]], WrappedException]:
    """Read what the background writer reported for these buckets (trainer, finalization).

    Args:
        channel: the save's :class:`ResultFile`, or a queue (anything with ``get``).
        write_buckets: the save's buckets (at least one), to check that each reported
            all of its items.
        checkpoint_dir, rank: for messages.

    Returns:
        ``(write results in bucket order, elapsed_s)``, or DCP's wrapped exception
        ``(exception, traceback.StackSummary)``: a
        :class:`~megatron_async.errors.StorageWriteError` when a bucket failed,
        :class:`~megatron_async.errors.WorkerDiedError` when the writer reported nothing,
        :class:`~megatron_async.errors.CheckpointIntegrityError` when a bucket reported
        too few results. The messages keep megatron-core's wording, as
        :meth:`WriteOutcome.payload` does.
    """
    try:
        payload = channel.get(timeout=_RESULTS_QUEUE_WAIT_S)
    except (OSError, EOFError, pickle.UnpicklingError, queue.Empty) as error:
        return wrap_exception(
            WorkerDiedError(
                f"Worker failure on rank {rank}: the background writer of "
                f"{checkpoint_dir} reported no result ({error}); it was probably "
                "killed (out of memory, signal) before finishing. The checkpoint is "
                "incomplete: save again."
            )
        )
    if isinstance(payload, BaseException):
        return wrap_exception(payload)
    for idx, bucket in enumerate(write_buckets):
        expected = len(bucket.data[0]) + len(bucket.data[1])
        got = len(payload.get(idx, ()))
        if got != expected:
            return wrap_exception(
                CheckpointIntegrityError(
                    f"rank {rank}: {bucket.file_name} in {checkpoint_dir} reported {got} "
                    f"of {expected} written items; its writer stopped early. This probably "
                    "indicates a worker failure. Save again."
                )
            )
    results = list(itertools.chain.from_iterable(payload[i] for i in sorted(payload)))
    return results, getattr(payload, "elapsed_s", None)
