"""Which caller runs a request's ``preload_fn``: ours, or another library's.

Some staging cannot finish inside ``preload_fn``: overlapped staging copies on a trainer
thread, and staging in rounds (a state above ``staging_memory_limit``) copies its later
rounds while the writer drains the pool. Both need the caller to call the staged data's
``start_background_copy`` / ``finish_staging`` once the request is with its writer
(:mod:`megatron_async.core.request`). Our callers do; megatron-core's and
nvidia-resiliency-ext's own ``AsyncCallsQueue`` do not know these hooks, so under them the
writer would wait for bytes that are never copied until its bound expires.

Our callers therefore run ``preload_fn`` through :func:`run_preload`, which marks the
calling thread; staging that needs the hand-over calls :func:`require_hand_over` first and
refuses at once, naming the fix, when another library's caller runs it.

Runs in the trainer (every rank).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from megatron_async.errors import StagingHandOverError

__all__ = ["run_preload", "caller_hands_over", "require_hand_over"]


class _CallerMark(threading.local):
    depth = 0


# Per thread, with no owner to pass: ``preload_fn`` takes no arguments (megatron-core's
# request format), so the thread running it is what tells whose caller runs it.
_mark = _CallerMark()


def run_preload(preload_fn: Callable[[], Any]) -> Any:
    """Run ``preload_fn`` as one of our callers, which finish the staging after the
    hand-over (trainer, every rank)."""
    _mark.depth += 1
    try:
        return preload_fn()
    finally:
        _mark.depth -= 1


def caller_hands_over() -> bool:
    """True inside :func:`run_preload` on this thread (trainer)."""
    return _mark.depth > 0


def require_hand_over(what: str, alternative: str) -> None:
    """Refuse staging that needs the hand-over hooks outside our callers (trainer).

    Args:
        what: the staging that was asked for, as the message should name it.
        alternative: how to save without it under the caller in use.

    Raises:
        StagingHandOverError: ``preload_fn`` was not run by one of our callers.
    """
    if caller_hands_over():
        return
    raise StagingHandOverError(
        f"{what} continues after the request is handed to its writer, which only "
        "megatron_async's callers arrange; this request's preload_fn was run by another "
        "library's AsyncCallsQueue (megatron-core's or nvidia-resiliency-ext's). Schedule "
        f"it on megatron_async.AsyncCallsQueue, or {alternative}. Nothing was staged or "
        "written; the previous checkpoint is intact"
    )
