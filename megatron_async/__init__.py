"""megatron_async: asynchronous torch_dist checkpointing for megatron-core.

Importing the package registers :class:`TorchDistAsyncSaveStrategy` with megatron-core
as the default save strategy of the backend name ``'megatron_async'`` (see
:func:`register_strategies`); this imports megatron-core. Background worker processes
skip that registration (they never look strategies up), which keeps their start-up
to the cost of importing torch.
"""

import os as _os

from megatron_async.core import (
    AsyncCallerConfig,
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
)
from megatron_async.errors import AsyncCheckpointError, AsyncSaveFailedError

__version__ = "0.1.0"

BACKGROUND_WORKER_ENV = "MEGATRON_ASYNC_BACKGROUND_WORKER"
"""Set to ``1`` in the environment of our background workers (see the docstring above)."""

__all__ = [
    "AsyncCallerConfig",
    "AsyncCallsQueue",
    "AsyncCheckpointError",
    "AsyncRequest",
    "AsyncSaveFailedError",
    "FileSystemWriterAsync",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
    "TorchAsyncCheckpoint",
    "TorchDistAsyncSaveStrategy",
    "TorchDistSaveConfig",
    "register_strategies",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]

_LAZY = {
    "FileSystemWriterAsync": "megatron_async.filesystem_async",
    "save_state_dict_async_finalize": "megatron_async.state_dict_saver",
    "save_state_dict_async_plan": "megatron_async.state_dict_saver",
    "verify_global_md_reuse": "megatron_async.state_dict_saver",
    "TorchDistAsyncSaveStrategy": "megatron_async.strategy",
    "TorchDistSaveConfig": "megatron_async.strategy",
    "register_strategies": "megatron_async.strategy",
    "TorchAsyncCheckpoint": "megatron_async.torch_ckpt",
}


def __getattr__(name):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'megatron_async' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)


if _os.environ.get(BACKGROUND_WORKER_ENV) != "1":
    import warnings as _warnings

    with _warnings.catch_warnings():
        # megatron-core announces on import that optional fused kernels (TE, Apex) are
        # absent, several times; it changes nothing for checkpointing, and the command
        # line tools would otherwise open with a screenful of it.
        _warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
        from megatron_async.strategy import register_strategies as _register_strategies

    _register_strategies()
