"""The channel through which a background writer reports one save's results.

The background writer hands its results back through a :class:`ResultFile` rather than a
multiprocessing queue: a queue cannot be pickled into an already running persistent
worker, and a pipe blocks the writer as soon as its results outgrow the pipe
buffer while the trainer is not reading yet. A small file works the same for a forked
child, the persistent worker and a synchronous call. The trainer creates the channel;
the writer (a thread, a forked process or the persistent worker) fills it.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import shutil
import tempfile
import threading
import uuid
from typing import Any, Dict, List, Optional, Union

from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.errors import RankFailure, StorageWriteError

__all__ = ["BucketResults", "WriteOutcome", "ResultFile"]

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

    Created in the trainer; pickles as a path, so it reaches a forked child, the
    persistent worker or the calling thread alike. The writer :meth:`put` s one object
    (written to a temporary name and renamed, so the reader never sees half a file); the
    trainer :meth:`take` s it once the background part is done.
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
