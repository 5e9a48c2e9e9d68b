"""The async execution core: requests, background callers and the calls queue.

Names match megatron-core's ``dist_checkpointing.strategies.async_utils`` and
nvidia-resiliency-ext's ``checkpointing.async_ckpt.core``, so switching is one import.
"""

from megatron_async.core.caller import AsyncCaller, CallState, CallStatus
from megatron_async.core.config import AsyncCallerConfig
from megatron_async.core.persistent import PersistentAsyncCaller
from megatron_async.core.queue import AsyncCallsQueue
# Re-exported, not public: megatron-core's async_utils module has it (code imports it).
from megatron_async.core.queue import _ActiveAsyncRequest as _ActiveAsyncRequest
from megatron_async.core.request import AsyncRequest
from megatron_async.core.temporal import TemporalAsyncCaller

__all__ = [
    "AsyncRequest",
    "AsyncCaller",
    "TemporalAsyncCaller",
    "PersistentAsyncCaller",
    "AsyncCallsQueue",
    "AsyncCallerConfig",
    "CallState",
    "CallStatus",
]
