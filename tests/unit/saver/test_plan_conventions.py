"""Planning's calling conventions: megatron-core's and nvidia-resiliency-ext's, each in its module."""

from __future__ import annotations

import pytest
import torch

import megatron_async
from megatron_async import state_dict_saver as public_saver
from megatron_async.nvrx import state_dict_saver as nvrx_saver
from megatron_async.saver import state_dict_saver as saver
from megatron_async.saver.metadata_cache import CheckpointMetadataCache
from megatron_async.buckets.layout import PreparedWrite
from megatron_async.writer.filesystem import FileSystemWriterAsync

pytestmark = pytest.mark.timeout(120)

def _state():
    return {"a": torch.arange(16, dtype=torch.float32), "b": torch.ones(8)}

def test_the_public_path_is_the_savers_one_function(tmp_path):
    assert public_saver.save_state_dict_async_plan is saver.save_state_dict_async_plan
    planned = saver.save_state_dict_async_plan(_state(), FileSystemWriterAsync(str(tmp_path)))
    assert len(planned) == 5 and len(planned[0]) == 3

def test_plan_save_reports_what_the_writer_prepared(tmp_path):
    writer = FileSystemWriterAsync(str(tmp_path), thread_count=2)
    result = saver.plan_save(_state(), writer)
    assert result.writer is writer and result.finalize_args[0] is writer
    assert isinstance(result.prepared_write, PreparedWrite)
    assert result.prepared_write.write_buckets == writer.write_buckets
    assert not result.reused_cached_plans

def test_each_convention_has_its_module(tmp_path):
    assert megatron_async.save_state_dict_async_plan is public_saver.save_state_dict_async_plan
    five = public_saver.save_state_dict_async_plan(_state(), FileSystemWriterAsync(str(tmp_path / "a")))
    assert len(five) == 5
    cache = CheckpointMetadataCache()
    for step in range(2):
        writer = FileSystemWriterAsync(str(tmp_path / f"b{step}"))
        three = nvrx_saver.save_state_dict_async_plan(
            _state(), writer, enable_cache=True, metadata_cache=cache
        )
        assert len(three) == 3 and three[0] is writer and three[1] is not None
    assert cache.cached_central_plan is not None and cache.validated_cache_reuse
    off = nvrx_saver.save_state_dict_async_plan(
        _state(), FileSystemWriterAsync(str(tmp_path / "c")), enable_cache=False
    )
    assert len(off) == 3

def test_the_nvrx_module_keeps_its_three_element_shape(tmp_path):
    planned = nvrx_saver.save_state_dict_async_plan(_state(), FileSystemWriterAsync(str(tmp_path)))
    assert len(planned) == 3
