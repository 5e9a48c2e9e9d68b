"""Terminal output of the example: a live status line on a TTY, plain lines elsewhere.

Only rank 0 creates an enabled :class:`Progress`; other ranks get a silent one.
"""

from __future__ import annotations

import json
import sys
import time
from typing import IO, Iterable, Optional

__all__ = ["Progress", "format_bytes"]

_CLEAR_LINE = "\r\x1b[2K"
_BAR_WIDTH = 20


def format_bytes(num_bytes: float) -> str:
    """Human-readable size: ``1.5 MiB``."""
    if num_bytes < 1024:
        return f"{int(num_bytes)} B"
    for unit in ("KiB", "MiB", "GiB"):
        num_bytes /= 1024
        if num_bytes < 1024 or unit == "GiB":
            break
    return f"{num_bytes:.1f} {unit}"


class Progress:
    """Show iteration, loss and checkpoints in flight; log events as permanent lines.

    Args:
        total_iters: the last iteration of the run.
        enabled: False makes every method a no-op (ranks other than 0).
        log_interval: without a TTY, print a status line every this many iterations.
        metrics_file: if set, append one JSON object per iteration and per event here.
        stream: where to print; a TTY gets a redrawn status line.
    """

    def __init__(
        self,
        total_iters: int,
        enabled: bool,
        log_interval: int = 1,
        metrics_file: Optional[str] = None,
        stream: IO[str] = sys.stdout,
    ):
        self.total_iters = total_iters
        self.enabled = enabled
        self.log_interval = log_interval
        self.stream = stream
        self.interactive = enabled and stream.isatty()
        self._status = ""
        self._last_update: Optional[float] = None
        self._rate: Optional[float] = None
        self._metrics = None
        if enabled and metrics_file:
            self._metrics = open(metrics_file, "a", encoding="utf-8")

    def update(self, iteration: int, loss: float, in_flight: Iterable[int]) -> None:
        """Record one finished iteration and refresh the status."""
        if not self.enabled:
            return
        self._record({"event": "iteration", "iteration": iteration, "loss": loss})
        in_flight = list(in_flight)
        ckpt = f"saving iter {', '.join(map(str, in_flight))}" if in_flight else "no save in flight"
        status = f"iter {iteration:>6d}/{self.total_iters} | loss {loss:.6f} | {ckpt}"
        if self.interactive:
            now = time.monotonic()
            if self._last_update is not None and now > self._last_update:
                rate = 1.0 / (now - self._last_update)
                self._rate = rate if self._rate is None else 0.8 * self._rate + 0.2 * rate
            self._last_update = now
            filled = _BAR_WIDTH * iteration // max(self.total_iters, 1)
            bar = "#" * filled + "." * (_BAR_WIDTH - filled)
            speed = f" | {self._rate:5.1f} it/s" if self._rate else ""
            status = f"[{bar}] {status}{speed}"
            self._status = status
            self.stream.write(_CLEAR_LINE + status)
            self.stream.flush()
        elif iteration % self.log_interval == 0 or iteration == self.total_iters:
            self._print(status)

    def event(self, text: str, **metrics) -> None:
        """Print ``text`` as a permanent line (above the status line on a TTY)."""
        if not self.enabled:
            return
        if metrics:
            self._record(dict(metrics))
        if self.interactive:
            self.stream.write(_CLEAR_LINE + text + "\n" + self._status)
            self.stream.flush()
        else:
            self._print(text)

    def close(self) -> None:
        """End the status line and close the metrics file."""
        if self.interactive and self._status:
            self.stream.write("\n")
            self.stream.flush()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _record(self, obj) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(obj) + "\n")
            self._metrics.flush()
