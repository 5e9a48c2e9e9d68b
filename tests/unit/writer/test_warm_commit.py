"""A warm save's commit: the reuse check, the spliced ``.metadata`` and the per-rank checksums.

In one process (no torch.distributed): the finalization's decision and the coordinator's
commit run on a single rank; the multi-rank agreement is tested in
``tests/functional/scenarios_strategy.py`` (``warm_saves_gather_no_write_results``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron_async.core import coordination
from megatron_async.format import checksum_record_name
from megatron_async.integrity import checksums
from megatron_async.saver import finalize
from megatron_async.writer.commit import storage_layout
from megatron_async.writer.filesystem import FileSystemWriterAsync
from megatron_async.writer.metadata_bytes import MetadataTemplate, metadata_pickle
from tests.unit.writer.test_filesystem_async import _prepare, _run

pytestmark = pytest.mark.timeout(120)


def _metadata(items: int, checkpoint_id="/ckpt/iter_0000001", save_id="a" * 32) -> Metadata:
    """Metadata of ``items`` tensors, large enough for a protocol-4 pickle of many frames."""
    state, storage = {}, {}
    for i in range(items):
        fqn = f"decoder.layers.{i}.mlp.weight"
        chunk = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([8, 8]))
        properties = TensorProperties(dtype=torch.bfloat16)
        state[fqn] = TensorStorageMetadata(properties, torch.Size([8, 8]), [chunk])
        storage[MetadataIndex(fqn, (0, 0))] = _StorageInfo(f"__{i % 4}_0.distcp", i * 128, 128)
    meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
    return Metadata(state, storage_data=storage, storage_meta=meta)


NEW_IDS = ["/c", "/ckpt/iter_0000002", "/" + "long/" * 60, "/" + "x" * 254, "/" + "y" * 255]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("items", [3, 4000], ids=["one-frame", "many-frames"])
def test_spliced_metadata_unpickles_equal_to_a_fresh_pickle(protocol, items):
    metadata = _metadata(items)
    metadata.extra_attribute = ["kept", {"by": "the template"}]  # not a dataclass field
    template = MetadataTemplate.build(metadata, protocol)
    assert template is not None
    for checkpoint_id in NEW_IDS:
        storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id="b" * 32)
        fresh = copy.copy(metadata)
        fresh.storage_meta = storage_meta
        spliced = template.render(storage_meta)
        unpickled = pickle.loads(spliced)
        assert unpickled == fresh and vars(unpickled) == vars(fresh), checkpoint_id
        if protocol < 4:  # no frames: the very bytes a pickler writes
            assert spliced == pickle.dumps(fresh, protocol=protocol)


def test_the_template_renders_the_save_it_was_made_from():
    metadata = _metadata(50)
    data, template = metadata_pickle(metadata)
    assert template is not None and pickle.loads(data) == metadata


def test_a_path_checkpoint_id_is_pickled_afresh():
    metadata = _metadata(5, checkpoint_id=Path("/ckpt/iter_1"))
    data, template = metadata_pickle(metadata)
    assert template is None and pickle.loads(data) == metadata


def test_a_value_that_is_not_a_short_string_is_pickled_afresh(tmp_path):
    from megatron_async.writer.commit import commit_unchanged

    metadata = _metadata(5)
    template = MetadataTemplate.build(metadata)
    odd = StorageMeta(checkpoint_id=Path("/p"), save_id="s")
    assert template.render(odd) is None
    assert template.render(StorageMeta(checkpoint_id="/" + "z" * (1 << 16), save_id="s")) is None
    commit_unchanged(str(tmp_path), template, odd)
    written = FileSystemReader(str(tmp_path)).read_metadata()
    assert written.storage_meta.checkpoint_id == Path("/p") and written.storage_meta.save_id == "s"
    assert written.storage_data == metadata.storage_data


def _results(count: int, moved: int = -1):
    from megatron_async.writer.bucket_io import ChecksummedWriteResult

    return [
        ChecksummedWriteResult(
            MetadataIndex(f"t{i}", [0]), 16, _StorageInfo("__0_0.distcp", i * 16 + (i == moved), 16)
        )
        for i in range(count)
    ]


def test_the_reuse_check_wants_every_item_where_it_was():
    cache = finalize.PreviousSave()
    assert not cache.matches(storage_layout(_results(3)), None, is_coordinator=False)
    cache.last = finalize.CommittedSave("/ckpt/iter_1", {}, storage_layout(_results(3)))
    assert cache.matches(storage_layout(_results(3)), None, is_coordinator=False)
    assert not cache.matches(storage_layout(_results(3, moved=1)), None, is_coordinator=False)
    assert not cache.matches(storage_layout(_results(4)), None, is_coordinator=False)
    assert not cache.matches(storage_layout(_results(2)), None, is_coordinator=False)


def test_the_coordinator_also_wants_the_committed_structure():
    structure = _metadata(2)
    cache = finalize.PreviousSave()
    layout = storage_layout(_results(2))
    cache.last = finalize.CommittedSave("/ckpt/iter_1", {}, layout)  # a rank's view: no commit of its own
    assert not cache.matches(layout, structure, is_coordinator=True)
    cache.last = finalize.CommittedSave("/ckpt/iter_1", {}, layout, structure, MetadataTemplate.build(structure))
    assert cache.matches(layout, structure, is_coordinator=True)
    assert not cache.matches(layout, _metadata(2), is_coordinator=True)  # equal, not the same


def _prepared_writer(path, state_dict):
    """A single rank's writer whose background write is done, and the global metadata."""
    writer = FileSystemWriterAsync(str(path), thread_count=2)
    metadata = _prepare(writer, state_dict)
    _run(writer)
    return writer, metadata


def test_a_warm_finalization_gathers_nothing_and_writes_a_loadable_metadata(tmp_path):
    previous = finalize.PreviousSave()
    wrapper = _DistWrapper(None, False, 0)
    structure = None
    for step in range(3):
        path = tmp_path / f"iter_{step}"
        path.mkdir()
        state = {"w": torch.full((64, 8), float(step)), "b": torch.arange(8.0) + step}
        writer, metadata = _prepared_writer(path, state)
        structure = structure or metadata  # the cached global metadata, as the plan cache keeps it
        before = coordination.gather_count("results")
        report = finalize.save_state_dict_async_finalize(
            writer, structure, wrapper, previous_save=previous
        )
        assert coordination.gather_count("results") - before == (1 if step == 0 else 0), step

        loaded = {k: torch.empty_like(v) for k, v in state.items()}
        dcp.load(loaded, storage_reader=FileSystemReader(str(path)), no_dist=True)
        assert all(torch.equal(loaded[k], v) for k, v in state.items()), step
        written = FileSystemReader(str(path)).read_metadata()
        assert written.storage_meta.checkpoint_id == str(path)
        assert written.storage_meta.save_id == writer.save_id
        assert report.items == 2
        assert report.changed == 2  # new to the history at step 0, new values after
        items = checksums.read_checksums(str(path))
        assert len(items) == 2 and checksums.verify_items(str(path), items) == []


def test_a_failed_full_commit_leaves_no_layout_to_match_and_keeps_the_digests(tmp_path):
    """A full commit that fails must not leave the previous layout and template, which a
    later warm save would reuse for a commit that was never written; the stale check
    still compares with the last committed save."""
    from megatron_async.errors import AsyncSaveFailedError

    previous, wrapper = finalize.PreviousSave(), _DistWrapper(None, False, 0)
    (tmp_path / "iter_0").mkdir()
    writer, metadata = _prepared_writer(tmp_path / "iter_0", {"w": torch.ones(8)})
    finalize.save_state_dict_async_finalize(writer, metadata, wrapper, previous_save=previous)
    (tmp_path / "iter_1").mkdir()
    writer, _ = _prepared_writer(tmp_path / "iter_1", {"w": torch.ones(8)})
    with pytest.raises(AsyncSaveFailedError, match="no metadata"):  # the coordinator lost it
        finalize.save_state_dict_async_finalize(writer, None, wrapper, previous_save=previous)
    last = previous.last
    assert (last.layout, last.template, last.checkpoint) == (None, None, str(tmp_path / "iter_0"))
    assert len(last.digests) == 1


def test_read_checksums_keeps_only_the_stored_items(tmp_path):
    state = {"w": torch.randn(16, 4)}
    writer, metadata = _prepared_writer(tmp_path, state)
    writer.finish(metadata, [writer.retrieve_write_results()])
    ours = checksums.read_checksums(str(tmp_path))
    assert [item.fqn for item in ours] == ["w"]
    # A record an earlier, unfinished save of a rank 7 left behind names other files.
    (result,) = writer.retrieve_write_results()
    elsewhere = dataclasses.replace(result.storage_data, relative_path="__7_0.distcp")
    stale = dataclasses.replace(result, storage_data=elsewhere)
    checksums.write_rank_record(str(tmp_path), 7, [stale])
    assert os.path.exists(tmp_path / checksum_record_name(7))
    assert checksums.read_checksums(str(tmp_path)) == ours
