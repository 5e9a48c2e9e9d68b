"""The coordinator's commit: one storage entry and one checksum per item of ``.metadata``.

Zero-length shards of an uneven split are written by every rank that holds one, several
at one offset, sometimes at the offset of another rank's data. The ranks are simulated
here: each writes its bucket with the real bucket writer and its checksum record, then
the commit runs; the checksums read back are those of exactly the stored items.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

from megatron_async.integrity import checksums
from megatron_async.saver.global_metadata import build_global_metadata
from megatron_async.writer.bucket_io import write_bucket
from megatron_async.buckets.layout import WriteBucket
from megatron_async.writer.commit import commit_checkpoint
from tests.unit.saver.test_global_metadata import save_planner, shard_item

pytestmark = pytest.mark.timeout(60)

HEAD = [0, 10, 20]  # rank 0 holds nothing at offset 0, where rank 1's data starts
TAIL = [20, 10, 0]  # rank 2 holds nothing at offset 30, the end of the tensor
WHOLE = {"head": torch.arange(30.0), "tail": torch.arange(30.0) * -1}


def _write_ranks(tmp_path, rank_order):
    """Write every simulated rank's shards; return the metadata and the ranks' results.

    The results are listed in ``rank_order``: which copy of an item the commit keeps must
    not depend on the order it sees them in.
    """
    splits = {"head": HEAD, "tail": TAIL}
    plans, results = [], []
    for rank in range(3):
        pairs = []
        for fqn, sizes in splits.items():
            offset = sum(sizes[:rank])
            item = shard_item(fqn, [offset], [sizes[rank]], [30])
            pairs.append((item, WHOLE[fqn][offset : offset + sizes[rank]].clone()))
        name = f"__{rank}_0.distcp"
        plans.append(SavePlan([item for item, _ in pairs]))
        bucket = WriteBucket(str(tmp_path / name), name, ([], pairs))
        results.append(write_bucket(_StorageWriterTransforms(), bucket, use_fsync=False))
        checksums.write_rank_record(str(tmp_path), rank, results[-1])
    metadata = build_global_metadata(save_planner(), plans)
    return metadata, [results[rank] for rank in rank_order]


@pytest.mark.parametrize("rank_order", [(0, 1, 2), (2, 1, 0)], ids=["rank-order", "reversed"])
def test_the_metadata_points_at_data_and_lists_each_item_once(tmp_path, rank_order):
    metadata, results = _write_ranks(tmp_path, rank_order)
    assert [r.empty_chunk for r in results[rank_order.index(0)]] == [True, False]
    commit_checkpoint(str(tmp_path), metadata, results, None)

    stored = FileSystemReader(str(tmp_path)).read_metadata().storage_data
    where = {(index.fqn, tuple(index.offset)): info.relative_path for index, info in stored.items()}
    assert where[("head", (0,))] == "__1_0.distcp"  # rank 1's data, never rank 0's empty shard
    assert where[("tail", (30,))] == "__2_0.distcp"
    assert len(where) == 5  # head at 0 and 10; tail at 0, 20 and 30
    records = checksums.read_checksums(str(tmp_path))
    assert sorted((r.fqn, tuple(r.chunk_offsets), r.file) for r in records) == sorted(
        (fqn, offsets, name) for (fqn, offsets), name in where.items()
    )
    assert checksums.verify_items(str(tmp_path), records) == []

    loaded = {fqn: torch.empty(30) for fqn in WHOLE}
    dcp.load(loaded, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    for fqn, tensor in WHOLE.items():
        assert torch.equal(loaded[fqn], tensor), fqn


def test_duplicate_empty_shards_keep_the_lowest_rank_s_entry(tmp_path):
    metadata, results = _write_ranks(tmp_path, (0, 1, 2))
    # A fourth rank with an empty shard at offset 30 too, in a file that is gone since.
    (empty,) = [r for r in results[2] if r.index.fqn == "tail"]
    elsewhere = dataclasses.replace(empty.storage_data, relative_path="__3_0.distcp")
    results.append([dataclasses.replace(empty, storage_data=elsewhere)])
    checksums.write_rank_record(str(tmp_path), 3, results[-1])
    commit_checkpoint(str(tmp_path), metadata, results, None)

    stored = FileSystemReader(str(tmp_path)).read_metadata().storage_data
    assert len(stored) == 5
    assert stored[MetadataIndex("tail", [30])].relative_path == "__2_0.distcp"
    records = checksums.read_checksums(str(tmp_path))
    assert len(records) == 5 and checksums.verify_items(str(tmp_path), records) == []


def test_the_empty_chunk_flag_survives_pickling(tmp_path):
    _, results = _write_ranks(tmp_path, (0, 1, 2))
    flags = [[r.empty_chunk for r in rank_results] for rank_results in results]
    assert pickle.loads(pickle.dumps(results)) == results
    assert flags == [[True, False], [False, False], [False, True]]
