"""megatron_async: asynchronous torch_dist checkpointing for megatron-core.

The pipeline of one save, one package per stage::

    core/       requests, the queue, the background callers and their worker
    staging/    the host snapshot of every tensor (trainer)
    writer/     the DCP storage writer: buckets, files, checksums, .metadata
    saver/      plan and finalize a DCP save over the gloo coordination group
    mcore/      the megatron-core strategy and the per-generation glue
    integrity/  checksums, completeness, inspection
    storage/    where checkpoints live: one CheckpointStorage per path (local files or
                multi-storage-client objects), chosen once by storage_for
    buckets/    the write buckets every stage shares: their layout, the files they
                become, the digest of every item
    format.py   names on disk and the completeness rule; manager.py, checkpoint_dirs.py,
                torch_ckpt.py, cli.py around them

Importing the package imports its public names and registers
:class:`TorchDistAsyncSaveStrategy` with megatron-core where megatron-core has a strategy
registry (0.16.x; see :mod:`megatron_async.mcore.generation`), which imports
megatron-core.
"""

import warnings as _warnings

__version__ = "0.3.0"

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

with _warnings.catch_warnings():
    # megatron-core announces on import that optional packages (TE, Apex; absl on 0.17+)
    # are absent; it changes nothing for checkpointing, nor for the command line's output.
    _warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
    _warnings.filterwarnings("ignore", message="absl.logging is not installed")
    from megatron_async.core import (
        AsyncCallerConfig, AsyncCallsQueue, AsyncRequest, PersistentAsyncCaller, TemporalAsyncCaller,
    )
    from megatron_async.errors import AsyncCheckpointError, AsyncSaveFailedError
    from megatron_async.mcore.config import TorchDistSaveConfig
    from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy, register_strategies
    from megatron_async.state_dict_saver import (
        save_state_dict_async_finalize, save_state_dict_async_plan, verify_global_md_reuse,
    )
    from megatron_async.torch_ckpt import TorchAsyncCheckpoint
    from megatron_async.writer.filesystem import FileSystemWriterAsync

register_strategies()
