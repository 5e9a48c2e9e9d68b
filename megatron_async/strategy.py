"""Public import path of the megatron-core save strategy (implementation: :mod:`megatron_async.mcore`)."""

from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.mcore.strategy import (
    REGISTERED_BACKEND,
    TorchDistAsyncSaveStrategy,
    checkpoint_dirs_in_flight,
    register_strategies,
)

__all__ = [
    "TorchDistAsyncSaveStrategy",
    "TorchDistSaveConfig",
    "REGISTERED_BACKEND",
    "register_strategies",
    "checkpoint_dirs_in_flight",
]
