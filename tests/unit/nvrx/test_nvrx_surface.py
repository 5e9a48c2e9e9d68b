"""The nvidia-resiliency-ext module surface: names, signatures, serving, the metadata reader."""

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_async.nvrx.cached_metadata_filesystem_reader import CachedMetadataFileSystemReader
from megatron_async.errors import ModuleSurfaceConflictError
from megatron_async.nvrx import state_dict_saver as nvrx_saver
from megatron_async.saver.metadata_cache import CheckpointMetadataCache

REPO_ROOT = Path(__file__).resolve().parents[3]

# What megatron-core 0.17+ imports from nvidia_resiliency_ext (strategies/torch.py, nvrx.py).
MEGATRON_IMPORTS = {
    "core": ["AsyncCallsQueue", "AsyncRequest"],
    "cached_metadata_filesystem_reader": ["CachedMetadataFileSystemReader"],
    "filesystem_async": ["FileSystemWriterAsync", "get_write_results_queue", "_results_queue"],
    "state_dict_saver": [
        "CheckpointMetadataCache",
        "save_state_dict_async_finalize",
        "save_state_dict_async_plan",
    ],
}


@pytest.mark.parametrize("module", sorted(MEGATRON_IMPORTS))
def test_every_name_megatron_imports_exists(module):
    imported = __import__(f"megatron_async.nvrx.{module}", fromlist=["_"])
    for name in MEGATRON_IMPORTS[module]:
        assert hasattr(imported, name), (module, name)


def test_plan_signature_takes_the_cache_keywords():
    parameters = inspect.signature(nvrx_saver.save_state_dict_async_plan).parameters
    assert list(parameters)[:5] == [
        "state_dict",
        "storage_writer",
        "process_group",
        "coordinator_rank",
        "planner",
    ]
    assert parameters["enable_cache"].default is False
    assert parameters["metadata_cache"].default is None


def _record(cache, reused_cached_plans):
    """What planning records in the cache after a save (plan_with_cache)."""
    cache.cached_central_plan, cache.cached_local_plan = "central", "local"
    cache.validated_cache_reuse, cache.validated_loaded_metadata_reuse = reused_cached_plans, False


def test_metadata_cache_fills_in_reused_metadata_and_keeps_fresh_metadata():
    cache = CheckpointMetadataCache()
    assert not cache.can_offer_cached_plans(is_coordinator=True)
    fresh = object()
    _record(cache, False)
    assert cache.prepare_save_state_dict_ret(0, 0, ("w", fresh, "d")) == ("w", fresh, "d")
    assert cache.get_cache_metadata() == ("central", "local", False, None)
    assert cache.can_offer_cached_plans(is_coordinator=True)
    # the next save reused the plans: no metadata was built, the cached one is returned,
    # on the coordinator only
    _record(cache, True)
    assert cache.validated_cache_reuse
    assert cache.prepare_save_state_dict_ret(0, 0, ("w", None, "d")) == ("w", fresh, "d")
    assert cache.prepare_save_state_dict_ret(1, 0, ("w", None, "d")) == ("w", None, "d")


def test_metadata_cache_without_metadata_makes_the_coordinator_plan_afresh():
    cache = CheckpointMetadataCache()
    _record(cache, False)  # a non-coordinator rank
    assert cache.can_offer_cached_plans(is_coordinator=False)
    assert not cache.can_offer_cached_plans(is_coordinator=True)


def test_loaded_metadata_seeds_the_plans_to_verify():
    class Loaded:
        megatron_async_plan_digests = [b"plan0", b"plan1"]

    cache = CheckpointMetadataCache()
    cache.set_cached_global_metadata(Loaded())
    assert cache.loaded_all_plans == [b"plan0", b"plan1"]
    cache.set_cached_global_metadata(None)
    assert cache.loaded_all_plans is None


def _save(path: Path, value: float) -> None:
    dcp.save({"w": torch.full((4,), value)}, checkpoint_id=str(path), no_dist=True)


def test_cached_reader_serves_the_cache_until_the_checkpoint_is_rewritten(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    _save(path, 1.0)
    CachedMetadataFileSystemReader.clear_metadata_cache()
    reads = []
    original = dcp.FileSystemReader.read_metadata

    def counting_read(self):
        reads.append(self.path)
        return original(self)

    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", counting_read)
    first = CachedMetadataFileSystemReader(path).read_metadata()
    assert CachedMetadataFileSystemReader(str(path)).read_metadata() is first
    assert len(reads) == 1
    os.utime(path / ".metadata", ns=(1, 1))  # a rewrite changes the file's identity
    assert CachedMetadataFileSystemReader(path).read_metadata() is not first
    assert len(reads) == 2
    CachedMetadataFileSystemReader(path, cache_metadata=False).read_metadata()
    assert len(reads) == 3
    CachedMetadataFileSystemReader.clear_metadata_cache()
    CachedMetadataFileSystemReader(path).read_metadata()
    assert len(reads) == 4
    loaded = {"w": torch.zeros(4)}
    dcp.load(loaded, storage_reader=CachedMetadataFileSystemReader(path), no_dist=True)
    assert torch.equal(loaded["w"], torch.full((4,), 1.0))


def _run_python(code: str, extra_path: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra_path, str(REPO_ROOT)) if p))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


def test_serving_makes_the_module_paths_resolve_to_ours():
    proc = _run_python(
        """
        import importlib
        from megatron_async.nvrx import is_served, serve_as_nvidia_resiliency_ext
        assert not is_served()
        serve_as_nvidia_resiliency_ext()
        serve_as_nvidia_resiliency_ext()
        import nvidia_resiliency_ext
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            CheckpointMetadataCache, save_state_dict_async_plan)
        import megatron_async.core, megatron_async.nvrx.state_dict_saver as ours
        assert AsyncCallsQueue is megatron_async.core.AsyncCallsQueue
        assert save_state_dict_async_plan is ours.save_state_dict_async_plan
        assert nvidia_resiliency_ext.__version__ == "0.6.0"
        mod = importlib.import_module(
            "nvidia_resiliency_ext.checkpointing.async_ckpt.cached_metadata_filesystem_reader")
        assert mod.CachedMetadataFileSystemReader
        try:
            import nvidia_resiliency_ext.fault_tolerance
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("only the async checkpointing modules may be served")
        from megatron_async.mcore import generation
        if generation.GENERATION == "builtin":
            from megatron.core.dist_checkpointing.strategies.nvrx import has_nvrx_async_support
            assert has_nvrx_async_support()
        print("served")
        """
    )
    assert proc.returncode == 0 and "served" in proc.stdout, proc.stderr[-3000:]


def test_serving_includes_the_local_checkpoint_modules_megatron_lm_imports():
    proc = _run_python(
        """
        from megatron_async.nvrx import serve_as_nvidia_resiliency_ext
        serve_as_nvidia_resiliency_ext()
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager)
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
            CheckpointingException, CkptID, SameMachineReplicationException)
        from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import (
            ExchangePlan, ExchangePlanEntry, GroupWrapper, ProcessGroupLike, batched,
            parse_group_sequence)
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
            CliqueReplicationStrategy, LazyCliqueReplicationStrategy,
            LazyReplicationStrategyBuilder, NoReplicasAvailableError, ReplicationStrategy)
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
            BasicTensorAwareStateDict, TensorPlaceholder, dict_list_map_inplace, nested_values)
        from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict
        import megatron_async.local.manager as ours
        assert LocalCheckpointManager is ours.LocalCheckpointManager
        assert issubclass(SameMachineReplicationException, CheckpointingException)
        from megatron.core.dist_checkpointing import tensor_aware_state_dict
        assert tensor_aware_state_dict.HAVE_NVRX
        assert issubclass(tensor_aware_state_dict.MCoreTensorAwareStateDict, TensorAwareStateDict)
        print("served")
        """
    )
    assert proc.returncode == 0 and "served" in proc.stdout, proc.stderr[-3000:]


def test_serving_refuses_when_the_real_package_is_installed(tmp_path):
    (tmp_path / "nvidia_resiliency_ext").mkdir()
    (tmp_path / "nvidia_resiliency_ext" / "__init__.py").write_text("")
    proc = _run_python(
        """
        from megatron_async.errors import ModuleSurfaceConflictError
        from megatron_async.nvrx import serve_as_nvidia_resiliency_ext
        try:
            serve_as_nvidia_resiliency_ext()
        except ModuleSurfaceConflictError as exc:
            assert "TorchDistAsyncSaveStrategy" in str(exc), exc
            print("refused")
        """,
        extra_path=str(tmp_path),
    )
    assert proc.returncode == 0 and "refused" in proc.stdout, proc.stderr[-3000:]
    assert issubclass(ModuleSurfaceConflictError, RuntimeError)
