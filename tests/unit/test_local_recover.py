"""megatron_async.local.recover: moving parts between ranks, seen from rank 0 of two.

The other rank is played by fakes of the coordination collectives and of the point to
point operations, so that one process sees what a peer that never sends does.
"""

import ctypes
import datetime
import io
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_async.core import coordination
from megatron_async.local import part_output, recover
from megatron_async.local.parts import LocalIdentity, file_version, part_name, record_name, scan
from tests.local_parts_aids import write_part

IDENTITY = LocalIdentity(world_size=2, replication_jump=1, replication_factor=2, run_id="r")


class _NeverDone:
    """A receive whose sender never sends: its wait runs out (gloo raises then)."""

    def __init__(self, waits):
        self._waits = waits

    def wait(self, timeout):
        self._waits.append(timeout)
        time.sleep(min(timeout.total_seconds(), 0.2))
        raise RuntimeError(f"Timed out waiting {timeout} for recv operation to complete")


def test_a_move_that_runs_out_of_time_ends_the_recovery_instead_of_an_older_iteration(
    tmp_path, monkeypatch, caplog
):
    # Rank 0 keeps iterations 1 and 2 of its part; its copy of 2 is damaged, so it must
    # receive rank 1's replica of it, which never arrives. Iteration 1 is intact on both,
    # but nothing is recovered: the peer is not well. The receive was posted on a group
    # of the recovery's own, destroyed after the ranks agreed, never on the coordination
    # group that later saves and recoveries use.
    for iteration in (1, 2):
        write_part(tmp_path, iteration, 0, [bytes([iteration]) * 100], IDENTITY)
    path = tmp_path / part_name(2, 0)
    path.write_bytes(b"\x09" * 100)
    peer_records = [r for r in scan(tmp_path)] + [
        r.__class__(r.iteration, 1, r.num_bytes, r.digest, IDENTITY) for r in scan(tmp_path)
    ]
    peer_intact = {r.key for r in peer_records}
    reductions, waits = [], []

    def all_gather_objects(obj, group=None):
        if isinstance(obj, tuple):  # (identity, scan)
            return [obj, (IDENTITY, peer_records, None)]
        return [obj, sorted(peer_intact)]

    def all_reduce_max(values, group=None):
        reductions.append(list(values))
        return list(values)

    monkeypatch.setattr(coordination, "all_gather_objects", all_gather_objects)
    monkeypatch.setattr(coordination, "all_reduce_max", all_reduce_max)
    transfer_group, created, destroyed, posted_on = object(), [], [], []

    def new_transfer_group(name, ranks, timeout_s):
        created.append((name, list(ranks)))
        return transfer_group

    targets = []

    def irecv(tensor, src, group=None):
        posted_on.append(group)
        targets.append((tensor.data_ptr(), tensor.numel()))
        return _NeverDone(waits)

    def destroy_process_group(group=None):  # after the agreement, not before
        # The receive still posted may write into its target until now, so the part's
        # mapping must still be there: reading it would crash this process otherwise.
        pointer, length = targets[0]
        destroyed.append((group, len(reductions), len(ctypes.string_at(pointer, length))))

    monkeypatch.setattr(coordination, "get_coordination_group", lambda *a, **k: object())
    monkeypatch.setattr(coordination, "new_transfer_group", new_transfer_group)
    monkeypatch.setattr(coordination, "coordination_timeout_s", lambda: 0.5)
    monkeypatch.setattr(dist, "irecv", irecv)
    monkeypatch.setattr(dist, "destroy_process_group", destroy_process_group)
    with caplog.at_level(logging.WARNING):
        assert recover.recover_newest(str(tmp_path), IDENTITY, 0) is None
    assert reductions == [[0], [0, 1]]  # the files opened; then stuck, not damaged: no iteration 1
    assert len(waits) == 1 and waits[0] <= datetime.timedelta(seconds=0.5)
    assert "did not finish in time" in caplog.text
    [(name, ranks)] = created
    assert name.startswith("megatron_async_local_recovery_") and name.endswith("_2")
    assert ranks == [0, 1]
    assert posted_on == [transfer_group] and destroyed == [(transfer_group, 2, 100)]
    assert not (tmp_path / part_name(2, 0, dirty=True)).exists()  # discarded after


def test_a_fresh_job_recovers_nothing_and_creates_no_group(tmp_path, monkeypatch):
    monkeypatch.setattr(
        coordination, "new_transfer_group", lambda *a: (_ for _ in ()).throw(AssertionError)
    )
    assert recover.recover_newest(str(tmp_path), IDENTITY.__class__(1, None, 1, "r"), 0) is None


class _Done:
    """A point-to-point operation that finished."""

    def wait(self, timeout):
        return True


def _part_bytes(value: float) -> bytes:
    stream = io.BytesIO()
    torch.save({"w": torch.full((1000,), value)}, stream)
    return stream.getvalue()


def _rank_1_sends_rank_0_its_part_of_iteration_2(tmp_path, monkeypatch, arrives, prepare=None):
    """Rank 0 keeps iterations 1 and 2 of its part, 2 damaged; rank 1 (the fakes) keeps
    its own parts and intact replicas of rank 0's, and sends rank 0 its part of 2:
    ``arrives(correct bytes)`` is what lands in rank 0's receive; ``prepare()`` runs once
    the files are in place. Returns the recovery's result and the agreements it took
    part in."""
    originals = {iteration: _part_bytes(float(iteration)) for iteration in (1, 2)}
    peer_dir = tmp_path / "peer"
    for iteration, data in originals.items():
        write_part(tmp_path, iteration, 0, [data], IDENTITY)
        write_part(peer_dir, iteration, 0, [data], IDENTITY)
    (tmp_path / part_name(2, 0)).write_bytes(b"\x09" * len(originals[2]))
    if prepare is not None:
        prepare()
    peer_records = scan(peer_dir) + [
        r.__class__(r.iteration, 1, r.num_bytes, r.digest, IDENTITY) for r in scan(peer_dir)
    ]
    reductions, received = [], []

    def all_gather_objects(obj, group=None):
        if isinstance(obj, tuple):  # (identity, scan, nonce)
            return [obj, (IDENTITY, peer_records, None)]
        return [obj, sorted(r.key for r in peer_records)]

    def all_reduce_max(values, group=None):
        reductions.append(list(values))
        return list(values)

    def irecv(tensor, src, group=None):
        assert src == 1
        data = arrives(originals[2])
        tensor.numpy()[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy()
        received.append(tensor.numel())
        return _Done()

    monkeypatch.setattr(coordination, "all_gather_objects", all_gather_objects)
    monkeypatch.setattr(coordination, "all_reduce_max", all_reduce_max)
    monkeypatch.setattr(coordination, "new_transfer_group", lambda *a: object())
    monkeypatch.setattr(dist, "irecv", irecv)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: None)
    result = recover.recover_newest(str(tmp_path), IDENTITY, 0)
    return result, reductions, received


def test_a_received_part_lands_in_its_file_written_back_and_loads_from_there(
    tmp_path, monkeypatch
):
    part, reductions, received = _rank_1_sends_rank_0_its_part_of_iteration_2(
        tmp_path, monkeypatch, lambda data: data
    )
    assert received == [len(_part_bytes(2.0))]
    assert reductions == [[0], [0, 0]]  # every receiver's file opened; the move went well
    assert (part.iteration, part.source, part.describe()) == (
        2, 1, "the replica of its part held by rank 1 (written back)"
    )
    path = tmp_path / part_name(2, 0)
    assert part.version == file_version(path)  # the file written back, as it is now
    assert scan(tmp_path)[-1] == part.record  # durable, with its record
    assert not (tmp_path / part_name(2, 0, dirty=True)).exists()
    assert torch.equal(recover.deserialize(part)[0]["w"], torch.full((1000,), 2.0))


def test_a_part_that_arrives_damaged_leaves_no_file_and_an_older_iteration_is_tried(
    tmp_path, monkeypatch, caplog
):
    def damaged(data):
        return b"\x00" + data[1:]

    with caplog.at_level(logging.WARNING):
        part, reductions, _ = _rank_1_sends_rank_0_its_part_of_iteration_2(
            tmp_path, monkeypatch, damaged
        )
    assert "damaged on its way" in caplog.text
    assert reductions == [[0], [1, 0], [0], [0, 0]]  # agreed damaged: iteration 1, nothing moves
    assert (part.iteration, part.source) == (1, 0)
    assert not (tmp_path / part_name(2, 0, dirty=True)).exists()
    assert torch.equal(recover.deserialize(part)[0]["w"], torch.full((1000,), 1.0))


@pytest.mark.parametrize("failing_step", ["open", "commit"])
def test_a_part_that_cannot_be_written_back_ends_the_recovery_on_every_rank(
    tmp_path, monkeypatch, caplog, failing_step
):
    # Nothing is loaded from memory: a rank whose holder directory refuses its part
    # (here its dirty file's name is taken by a directory) says so before anything
    # moves, and the ranks agree to recover nothing (no part is received into memory
    # instead); one whose part cannot be put in place once received agrees so after the
    # move. The older iteration would meet the same directory.
    def refuse(directory, record):
        raise OSError(28, "No space left on device")

    def fail_the_write_back():
        if failing_step == "open":
            os.makedirs(tmp_path / part_name(2, 0, dirty=True))
        else:
            monkeypatch.setattr(part_output, "_put_in_place", refuse)

    with caplog.at_level(logging.ERROR):
        part, reductions, received = _rank_1_sends_rank_0_its_part_of_iteration_2(
            tmp_path, monkeypatch, lambda data: data, fail_the_write_back
        )
    assert part is None
    if failing_step == "open":
        assert reductions == [[1]] and received == []  # agreed before anything moved
        assert "cannot write its local checkpoint part of iteration 2" in caplog.text
        assert "some rank cannot write its part of local checkpoint 2" in caplog.text
    else:
        assert reductions == [[0], [0, 1]] and received == [len(_part_bytes(2.0))]
        assert "could not be written back, on some rank" in caplog.text
        assert "No space left on device" in caplog.text
        assert not (tmp_path / part_name(2, 0, dirty=True)).exists()
