"""Strategy options, registration and generation detection, without a distributed job."""

import subprocess
import sys

import pytest

import megatron_async
from megatron_async.errors import CheckpointValidationError
from megatron_async.mcore import generation


@pytest.mark.skipif(generation.GENERATION != "registry", reason="megatron-core 0.17+ has no registry")
def test_registry_returns_our_strategy_writing_torch_dist_v1():
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy

    strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, "megatron_async", 1)
    assert isinstance(strategy, megatron_async.TorchDistAsyncSaveStrategy)
    assert (strategy.backend, strategy.version) == ("torch_dist", 1)


def test_a_backend_name_given_to_save_resolves_as_save_resolves_it():
    resolved = generation.resolve_strategy(("megatron_async", 1))
    if generation.GENERATION == "registry":
        assert isinstance(resolved, megatron_async.TorchDistAsyncSaveStrategy)
    else:  # 0.17+ has no registry: save() uses its own strategy for a name
        assert resolved is None
    assert generation.resolve_strategy(("no_such_backend", 1)) is None


@pytest.mark.skipif(generation.GENERATION != "builtin", reason="megatron-core 0.16.x")
def test_on_megatron_core_0_17_plus_save_keeps_our_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = megatron_async.TorchDistAsyncSaveStrategy(thread_count=3)
    assert isinstance(strategy, TorchDistSaveShardedStrategy)  # what save() keeps
    # The base class's defaults did not overwrite the chosen options.
    assert strategy.thread_count == 3 and strategy.config.thread_count == 3


def test_megatron_lm_constant_structure_switch_reuses_plans_and_staging_buffers():
    strategy = megatron_async.TorchDistAsyncSaveStrategy()
    # Without any switch: no plan cache, but staging buffers are reused (checked per save).
    assert strategy.use_cached_ckpt_structure is False
    assert strategy.config.use_cached_data_structure is True
    strategy.use_cached_ckpt_structure = True
    assert strategy.config.cached_metadata is True
    assert strategy.config.use_cached_data_structure is True
    # NeMo sets it to False explicitly: that turns off the plan cache only.
    strategy.use_cached_ckpt_structure = False
    assert strategy.config.cached_metadata is False
    assert strategy.config.use_cached_data_structure is True
    # megatron-core's constructor name means the same switch.
    assert megatron_async.TorchDistAsyncSaveStrategy(cached_metadata=True).use_cached_ckpt_structure


def test_staging_buffers_can_be_given_up_for_memory():
    strategy = megatron_async.TorchDistAsyncSaveStrategy(use_cached_data_structure=False)
    assert strategy.config.use_cached_data_structure is False
    strategy.release_staging_buffers()  # nothing held: a no-op
    assert strategy.staging_cache.num_bytes() == 0


def test_megatron_attribute_names_read_and_write_the_config():
    strategy = megatron_async.TorchDistAsyncSaveStrategy()
    strategy.thread_count = 4
    strategy.separation_hint = "optimizer"
    assert (strategy.config.thread_count, strategy.config.separation_hint) == (4, "optimizer")
    assert strategy.keep_only_main_replica is True


def test_unknown_option_and_bad_values_are_typed_errors():
    with pytest.raises(CheckpointValidationError, match="valid options"):
        megatron_async.TorchDistAsyncSaveStrategy(thread_cnt=2)
    with pytest.raises(CheckpointValidationError, match="thread_count must be an int >= 1"):
        megatron_async.TorchDistAsyncSaveStrategy(thread_count=0)
    with pytest.raises(CheckpointValidationError, match="torch_dist version 1"):
        megatron_async.TorchDistAsyncSaveStrategy("torch", 1)


def test_an_unsupported_megatron_core_fails_at_import_naming_what_is_missing(tmp_path):
    # A megatron-core without either generation's interfaces: dist_checkpointing exists,
    # strategies.torch lacks the translation functions we plug into.
    strategies = tmp_path / "megatron" / "core" / "dist_checkpointing" / "strategies"
    strategies.mkdir(parents=True)
    for folder in (tmp_path / "megatron", tmp_path / "megatron" / "core",
                   tmp_path / "megatron" / "core" / "dist_checkpointing", strategies):
        (folder / "__init__.py").write_text("")
    (strategies / "torch.py").write_text("class MCoreSavePlanner: pass\n")
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
        "try:\n    import megatron_async\nexcept ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "UnsupportedMegatronError" in out.stdout, out.stdout + out.stderr
    assert "mcore_to_pyt_state_dict" in out.stdout and "0.16" in out.stdout
