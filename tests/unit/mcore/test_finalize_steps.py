"""megatron-core's finalize steps swapped for the gloo-safe ones (``mcore/save_call.py``)."""

import functools

from megatron_async.core import request
from megatron_async.mcore import save_call


def _as_config_step(fn):
    """``fn`` disguised as ``save``'s local ``metadata_finalize_fn``."""
    fn.__module__ = save_call._SAVE_MODULE
    fn.__qualname__ = save_call._CONFIG_STEP
    return fn


def _config_step(checkpoint_dir, sharded_strategy):
    return _as_config_step(lambda: (checkpoint_dir, sharded_strategy))


def _config_step_with_empty_cells():
    """A closure megatron-core laid out differently: reading its cells raises ValueError."""
    step = _as_config_step(lambda: (checkpoint_dir, sharded_strategy))
    return step
    checkpoint_dir = sharded_strategy = None  # noqa: F841 (never runs: the cells stay empty)


class _Strategy:
    backend, version = "torch_dist", 1


def test_megatron_cores_config_step_is_swapped_and_an_unknown_layout_is_kept(tmp_path):
    assert request.finalize_step_adapter is save_call._replacement_for
    swapped = save_call._replacement_for(_config_step(tmp_path, _Strategy()))
    assert isinstance(swapped, functools.partial) and swapped.func is save_call.write_megatron_config
    assert swapped.args == (str(tmp_path), "torch_dist", 1)
    assert save_call._replacement_for(_config_step_with_empty_cells()) is None
    assert save_call._replacement_for(print) is None
