"""megatron_async.local.recover: moving parts between ranks, seen from rank 0 of two.

The other rank is played by fakes of the coordination collectives and of the point to
point operations, so that one process sees what a peer that never sends does.
"""

import datetime
import logging
import time

import torch.distributed as dist

from megatron_async.core import coordination
from megatron_async.local import recover
from megatron_async.local.part_output import write_part
from megatron_async.local.parts import LocalIdentity, part_name, scan

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

    def irecv(tensor, src, group=None):
        posted_on.append(group)
        return _NeverDone(waits)

    def destroy_process_group(group=None):  # after the agreement, not before
        destroyed.append((group, len(reductions)))

    monkeypatch.setattr(coordination, "get_coordination_group", lambda *a, **k: object())
    monkeypatch.setattr(coordination, "new_transfer_group", new_transfer_group)
    monkeypatch.setattr(coordination, "coordination_timeout_s", lambda: 0.5)
    monkeypatch.setattr(dist, "irecv", irecv)
    monkeypatch.setattr(dist, "destroy_process_group", destroy_process_group)
    with caplog.at_level(logging.WARNING):
        assert recover.recover_newest(str(tmp_path), IDENTITY, 0) is None
    assert reductions == [[0, 1]]  # agreed once: stuck, not damaged; iteration 1 not tried
    assert len(waits) == 1 and waits[0] <= datetime.timedelta(seconds=0.5)
    assert "did not finish in time" in caplog.text
    [(name, ranks)] = created
    assert name.startswith("megatron_async_local_recovery_") and name.endswith("_2")
    assert ranks == [0, 1]
    assert posted_on == [transfer_group] and destroyed == [(transfer_group, 1)]


def test_a_fresh_job_recovers_nothing_and_creates_no_group(tmp_path, monkeypatch):
    monkeypatch.setattr(
        coordination, "new_transfer_group", lambda *a: (_ for _ in ()).throw(AssertionError)
    )
    assert recover.recover_newest(str(tmp_path), IDENTITY.__class__(1, None, 1, "r"), 0) is None
