"""Options of the async execution core."""

from __future__ import annotations

import dataclasses

from megatron_async.errors import CheckpointValidationError

__all__ = ["AsyncCallerConfig", "DEFAULT_CONFIG", "STAGING_WAIT_S"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncCallerConfig:
    """Bounds and pacing of every wait in the async path.

    Every wait a trainer can get stuck in is bounded by one of these fields (staging's
    by :data:`STAGING_WAIT_S`), and each wait also checks that the background process is
    alive, so a dead worker is noticed within ``poll_interval_s`` rather than at the timeout.

    The one place the library's user-facing bounds are set: a queue and its callers read
    the config they were given; code that runs where no caller's config reaches it (the
    writer's own options, a coordination group created before any queue) takes its
    default from :data:`DEFAULT_CONFIG`, never from a literal of its own.
    """

    timeout_s: float = 3600.0
    """Longest the background part of a save may run before its process is killed and the
    save fails on every rank with a timeout: counted from the end of staging, when the
    temporal caller forks its writer or the persistent caller sends the request (the
    worker takes requests as they come and writes them in order, so a call's time
    includes its wait behind an earlier one)."""

    fork_start_timeout_s: float = 30.0
    """Longest a forked writer (the temporal caller's, or the persistent worker) may take
    to run its first line once forked; one that has not is hung in the child before any
    of our code runs (CPython gh-112275, or a library's at-fork handler that blocks). It
    is killed and the save fails on every rank at once instead of after ``timeout_s``."""

    poll_interval_s: float = 0.05
    """Pause between liveness/completion checks while waiting (blocking finalize, close)."""

    close_timeout_s: float = 60.0
    """Longest ``close()`` waits for a worker to stop cleanly before killing it."""

    coordination_timeout_s: float = 600.0
    """Bound on each checkpoint-coordination collective (how long a rank waits for a peer
    that stopped calling ``maybe_finalize_async_calls``). The first queue of a job decides
    it for the job's coordination group; a coordinator-only file-system step gets half of
    it (:mod:`megatron_async.core.save_directories`)."""

    writer_nice_increment: int = 10
    """Added to the trainer's nice value in the background processes (forked writers, the
    persistent worker, every thread they start), so that the writer yields the CPU to the
    training loop (a nice +10 thread gets about a tenth of the CPU time of a nice 0 thread
    on the same core); 0 keeps the trainer's priority, 19 is the lowest."""

    def __post_init__(self) -> None:
        nice = self.writer_nice_increment
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise CheckpointValidationError(
                "AsyncCallerConfig.writer_nice_increment must be an int from 0 to 19 (0 keeps "
                f"the trainer's CPU priority), got {nice!r}"
            )
        for field in dataclasses.fields(self):
            if field.name == "writer_nice_increment":
                continue
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise CheckpointValidationError(
                    f"AsyncCallerConfig.{field.name} must be a positive number of seconds, "
                    f"got {value!r}"
                )
        if self.poll_interval_s > self.timeout_s:
            raise CheckpointValidationError(
                "AsyncCallerConfig.poll_interval_s must not exceed timeout_s "
                f"(got poll_interval_s={self.poll_interval_s})"
            )


DEFAULT_CONFIG = AsyncCallerConfig()
"""The defaults, for the waits that no caller's config reaches (see :class:`AsyncCallerConfig`)."""


STAGING_WAIT_S = 600.0
"""Bound on each wait of staging (device-to-host copies, staging memory held by an earlier
save, an overlapped copy). Staging runs in the trainer inside ``preload_fn``, where no
caller's config reaches it."""
