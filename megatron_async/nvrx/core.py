"""``nvidia_resiliency_ext.checkpointing.async_ckpt.core``: the queue, requests and callers."""

from megatron_async.core import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
)

__all__ = [
    "AsyncCaller",
    "AsyncCallsQueue",
    "AsyncRequest",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
]
