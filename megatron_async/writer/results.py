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
from typing import Any, Dict, List, Optional

from torch.distributed.checkpoint.storage import WriteResult

from megatron_async.errors import RankFailure

__all__ = ["WriteOutcome", "ResultFile"]

logger = logging.getLogger(__name__)


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
