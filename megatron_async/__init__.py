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

Public names are imported on first use. Importing the package registers
:class:`TorchDistAsyncSaveStrategy` with megatron-core where megatron-core has a strategy
registry (0.16.x; see :mod:`megatron_async.mcore.generation`), which imports
megatron-core.
"""

import warnings as _warnings

__version__ = "0.3.0"

_LAZY = {
    "AsyncCallerConfig": "megatron_async.core",
    "AsyncCallsQueue": "megatron_async.core",
    "AsyncRequest": "megatron_async.core",
    "PersistentAsyncCaller": "megatron_async.core",
    "TemporalAsyncCaller": "megatron_async.core",
    "AsyncCheckpointError": "megatron_async.errors",
    "AsyncSaveFailedError": "megatron_async.errors",
    "FileSystemWriterAsync": "megatron_async.writer.filesystem",
    "save_state_dict_async_finalize": "megatron_async.state_dict_saver",
    "save_state_dict_async_plan": "megatron_async.state_dict_saver",
    "verify_global_md_reuse": "megatron_async.state_dict_saver",
    "TorchDistAsyncSaveStrategy": "megatron_async.mcore.strategy",
    "TorchDistSaveConfig": "megatron_async.mcore.config",
    "register_strategies": "megatron_async.mcore.strategy",
    "TorchAsyncCheckpoint": "megatron_async.torch_ckpt",
}
"""Each public name and the module it is imported from on first use."""

__all__ = sorted(_LAZY)


def __getattr__(name):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'megatron_async' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


with _warnings.catch_warnings():
    # megatron-core announces on import that optional packages (TE, Apex; absl on 0.17+)
    # are absent; it changes nothing for checkpointing, nor for the command line's output.
    _warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
    _warnings.filterwarnings("ignore", message="absl.logging is not installed")
    from megatron_async.mcore.strategy import register_strategies as _register_strategies

_register_strategies()
