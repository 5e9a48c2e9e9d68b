"""The benchmark's save methods and the warm-stall phase timer work on every megatron-core
generation (a GPU run found both still on 0.16's registry names, failing on 0.19.2)."""

import importlib

import pytest

from tools.bench.methods import queue as queue_methods
from tools.bench.micro import warm_stall


def test_our_method_builds_our_strategy_and_megatron_cores_its_own(tmp_path):
    from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy

    ours = queue_methods.OurQueueSave("ours_persistent", None, str(tmp_path), persistent=True,
                                      thread_count=3)
    strategy = ours._make_strategy()
    assert isinstance(strategy, TorchDistAsyncSaveStrategy)
    assert strategy.thread_count == 3 and strategy.use_cached_ckpt_structure
    assert ours.save_options == {}

    theirs = queue_methods.McoreQueueSave("mcore_async_temporal", None, str(tmp_path),
                                          persistent=False)
    strategy = theirs._make_strategy()
    assert not isinstance(strategy, TorchDistAsyncSaveStrategy)
    assert type(strategy).__module__.startswith("megatron.core.")
    mcore_torch = importlib.import_module("megatron.core.dist_checkpointing.strategies.torch")
    registry_generation = not hasattr(mcore_torch, "TorchDistSaveShardedStrategy")
    # From 0.17 save() runs megatron-core's own async path only with async_strategy="mcore".
    assert theirs.save_options == ({} if registry_generation else {"async_strategy": "mcore"})


def test_the_phase_timer_wraps_every_step_of_ours_and_skips_megatron_cores_missing_ones(
        monkeypatch):
    wrapped = []
    for module_name, attribute, _ in warm_stall._PHASES:
        owner = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        try:
            for part in path:
                owner = getattr(owner, part)
            monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
        except AttributeError:
            assert module_name.startswith("megatron.core."), (module_name, attribute)
            continue
        wrapped.append((owner, name))
    warm_stall.time_phases()
    for owner, name in wrapped:
        assert getattr(owner, name).__wrapped__ is not None
    assert any(module.startswith("megatron_async.") for module, _, _ in warm_stall._PHASES)


def test_a_missing_step_of_ours_is_an_error(monkeypatch):
    monkeypatch.setattr(warm_stall, "_PHASES", (
        ("megatron_async.mcore.plan_cache", "no_such_step", "a step that was renamed"),))
    with pytest.raises(AttributeError):
        warm_stall.time_phases()
