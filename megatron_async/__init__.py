"""megatron_async: asynchronous torch_dist checkpointing for megatron-core.

Importing the package registers :class:`TorchDistAsyncSaveStrategy` with megatron-core
as the default save strategy of the backend name ``'megatron_async'`` (see
:func:`register_strategies`); this imports megatron-core.
"""

from megatron_async.filesystem_async import FileSystemWriterAsync
from megatron_async.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
    verify_global_md_reuse,
)
from megatron_async.strategy import (
    TorchDistAsyncSaveStrategy,
    TorchDistSaveConfig,
    register_strategies,
)

__version__ = "0.1.0"

__all__ = [
    "FileSystemWriterAsync",
    "TorchDistAsyncSaveStrategy",
    "TorchDistSaveConfig",
    "register_strategies",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]

register_strategies()
