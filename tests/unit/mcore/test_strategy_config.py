"""Strategy options and registration, without a distributed job."""

import pytest
from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy

import megatron_async
from megatron_async.errors import CheckpointValidationError


def test_registry_returns_our_strategy_writing_torch_dist_v1():
    strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, "megatron_async", 1)
    assert isinstance(strategy, megatron_async.TorchDistAsyncSaveStrategy)
    assert (strategy.backend, strategy.version) == ("torch_dist", 1)


def test_megatron_lm_constant_structure_switch_maps_to_cached_metadata():
    strategy = megatron_async.TorchDistAsyncSaveStrategy()
    assert strategy.use_cached_ckpt_structure is False
    strategy.use_cached_ckpt_structure = True
    assert strategy.config.cached_metadata is True


def test_unknown_option_and_bad_values_are_typed_errors():
    with pytest.raises(CheckpointValidationError, match="valid options"):
        megatron_async.TorchDistAsyncSaveStrategy(thread_cnt=2)
    with pytest.raises(CheckpointValidationError, match="thread_count must be >= 1"):
        megatron_async.TorchDistAsyncSaveStrategy(thread_count=0)
    with pytest.raises(CheckpointValidationError, match="torch_dist version 1"):
        megatron_async.TorchDistAsyncSaveStrategy("torch", 1)
