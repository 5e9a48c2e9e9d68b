"""Host memory of a rank and of the background processes it started.

Two measures, for two questions:

* *peak RSS* (resident set size), sampled by a thread every few milliseconds: how high
  does memory go during a save? RSS counts shared pages in every process that maps them,
  so a forked writer that shares the trainer's pages copy-on-write shows them again;
  the rank and its background processes are therefore reported apart, never summed.
* *PSS* (proportional set size) of the rank plus all its descendants, read between
  saves: how much memory does checkpointing hold while training runs? PSS splits each
  shared page among the processes that map it, so the sum over processes counts
  shared-memory tensors and copy-on-write pages once.
"""

from __future__ import annotations

import os
import threading
import time
from typing import List, Tuple

import psutil

__all__ = ["RssSampler", "current_rss", "tree_pss_bytes", "wait_for_quiet_children"]


def _children(proc: psutil.Process) -> List[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except (psutil.Error, OSError):  # OSError: out of file descriptors, for one
        return []


def _rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except (psutil.Error, OSError):  # a child that exited between listing and reading
        return 0


def current_rss() -> Tuple[int, int]:
    """RSS of this process now, and the largest RSS of one of its descendants now: the
    baseline a save's peaks (:meth:`RssSampler.take_peaks`) are compared with."""
    proc = psutil.Process(os.getpid())
    return _rss(proc), max((_rss(c) for c in _children(proc)), default=0)


class RssSampler:
    """Samples the RSS of this process and of its descendants on a daemon thread.

    Runs on every rank. ``take_peaks`` returns the peaks since its previous call, so each
    save gets its own peaks.

    Args:
        interval_s: sampling period.
    """

    _CHILDREN_REFRESH = 5
    """Samples between two listings of the descendants (listing scans /proc: ~1 ms)."""

    def __init__(self, interval_s: float):
        self._interval_s = interval_s
        self._proc = psutil.Process(os.getpid())
        self._children: List[psutil.Process] = []
        self._samples = 0
        self._lock = threading.Lock()
        self._peak_self = 0
        self._peak_children = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self, refresh: bool = False) -> None:
        own = _rss(self._proc)
        if refresh or self._samples % self._CHILDREN_REFRESH == 0:
            self._children = _children(self._proc)
        self._samples += 1
        # Per-process peak of the background processes: a forked writer and a persistent
        # worker are separate processes, and their RSS must not be added (shared pages).
        children = max((_rss(c) for c in self._children), default=0)
        with self._lock:
            self._peak_self = max(self._peak_self, own)
            self._peak_children = max(self._peak_children, children)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def take_peaks(self) -> Tuple[int, int]:
        """Return ``(peak RSS of this rank, peak RSS of one background process)`` since the
        previous call, and start new peaks."""
        self._sample(refresh=True)
        with self._lock:
            peaks = (self._peak_self, self._peak_children)
            self._peak_self, self._peak_children = 0, 0
        return peaks

    def close(self) -> None:
        """Stop the sampling thread (bounded)."""
        self._stop.set()
        self._thread.join(timeout=5.0)


def tree_pss_bytes() -> Tuple[int, int]:
    """PSS of this process and the summed PSS of all its descendants (RSS without smaps)."""
    proc = psutil.Process(os.getpid())
    totals = []
    for group in ([proc], _children(proc)):
        total = 0
        for p in group:
            try:
                info = p.memory_full_info()
                total += getattr(info, "pss", info.rss)
            except (psutil.Error, OSError):
                continue
        totals.append(total)
    return totals[0], totals[1]


def wait_for_quiet_children(timeout_s: float, quiet_s: float = 1.0) -> bool:
    """Wait until the descendants' RSS stops changing for ``quiet_s`` (a worker that finished
    importing); return False when it did not settle within ``timeout_s``."""
    proc = psutil.Process(os.getpid())
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        children = _children(proc)
        now = tuple(sorted((c.pid, _rss(c) >> 20) for c in children))
        if now != last:
            last, since = now, time.monotonic()
        elif children and time.monotonic() - since >= quiet_s:
            return True
        time.sleep(0.1)
    return False
