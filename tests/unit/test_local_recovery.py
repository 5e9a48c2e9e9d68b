"""megatron_async.local.recovery: which local iteration to recover and from which copy.

The layout of the issue's test: 4 ranks on two "nodes" ({0, 1} and {2, 3}), J = 2, F = 2,
so the cliques are (0, 2) and (1, 3) and every holder keeps its own part and its peer's.
"""

import logging

from megatron_async.local.cliques import ExchangePlanEntry, parse_group_sequence
from megatron_async.local.parts import LocalIdentity, PartRecord
from megatron_async.local.recovery import (
    agreed_identity,
    choose_sources,
    complete_iterations,
    matching_identity,
    next_step,
    replicas_to_verify,
)

W = 4
IDENTITY = LocalIdentity(world_size=W, replication_jump=2, replication_factor=2, run_id="job")
CLIQUES = parse_group_sequence(2, 2, W)


def _record(iteration, owner, identity=IDENTITY):
    return PartRecord(iteration, owner, 10, f"digest-{iteration}-{owner}", identity)


def _inventories(*iterations, lost=()):
    """What every holder's scan finds after the saves of ``iterations``; a lost holder
    (its directory deleted with its node) finds nothing."""
    found = [[] for _ in range(W)]
    for clique in CLIQUES:
        for holder in clique:
            if holder not in lost:
                found[holder] = [_record(i, owner) for i in iterations for owner in clique]
    return found


def _intact(inventories, damaged=()):
    """Every holder's verification result: all its parts except the ``damaged`` copies
    (``(holder, iteration, owner)``)."""
    return [
        {r.key for r in records if (holder,) + r.key not in damaged}
        for holder, records in enumerate(inventories)
    ]


def _own_parts(intact):
    """The first verification round: each holder's own part only."""
    return [{key for key in held if key[1] == holder} for holder, held in enumerate(intact)]


def _senders(plan):
    return {e.receiver: e.sender for e in plan.entries}


def _recover(inventories, damaged=(), log=None):
    """The recovery's sequence, as recover_newest runs it: per complete iteration, newest
    first, each holder's own part verified, then the replicas next_step asks for; returns
    ``(iteration, plan)`` or None. ``log`` collects the replicas each step verified."""
    truth = _intact(inventories, damaged)  # what verifying a copy would find
    for iteration in complete_iterations(inventories, W):
        intact = [{k for k in held if k == (iteration, h)} for h, held in enumerate(truth)]
        step = next_step(iteration, inventories, intact, W, replicas_verified=False)
        if step.verify:
            if log is not None:
                log.append((iteration, step.verify))
            intact = [
                own | {r.key for r in step.verify.get(h, []) if r.key in truth[h]}
                for h, own in enumerate(intact)
            ]
            step = next_step(iteration, inventories, intact, W, replicas_verified=True)
            assert not step.verify  # replicas are verified once per iteration
        if step.plan is not None:
            return iteration, step.plan
    return None


def test_every_rank_reads_its_own_part_when_all_are_intact():
    inventories = _inventories(10, 20)
    assert complete_iterations(inventories, W) == [20, 10]
    iteration, plan = _recover(inventories)
    assert iteration == 20
    assert plan.entries == tuple(ExchangePlanEntry(r, r, (20, r)) for r in range(W))


def test_a_newer_iteration_that_not_every_owner_saved_is_passed_over():
    inventories = _inventories(10)
    inventories[0].append(_record(30, 0))  # a save that failed on the other ranks
    inventories[2].append(_record(30, 0))
    assert complete_iterations(inventories, W) == [10]
    assert _recover(inventories)[0] == 10


def test_a_lost_holder_directory_is_recovered_from_its_peers_replicas():
    inventories = _inventories(10, 20, lost={1})
    assert complete_iterations(inventories, W) == [20, 10]
    own = _own_parts(_intact(inventories))
    assert replicas_to_verify(20, inventories, own, W) == {3: [_record(20, 1)]}
    verified = []
    iteration, plan = _recover(inventories, log=verified)
    assert verified == [(20, {3: [_record(20, 1)]})]  # only the lost owner's replica is read
    assert iteration == 20 and _senders(plan) == {0: 0, 1: 3, 2: 2, 3: 3}
    assert plan.required_ids(3) == [(20, 1), (20, 3)]


def test_an_owner_whose_only_intact_copy_is_a_replica_reads_that_replica():
    inventories = _inventories(20)
    intact = _intact(inventories, damaged={(0, 20, 0)})  # rank 0's own file has a flipped byte
    assert replicas_to_verify(20, inventories, _own_parts(intact), W) == {2: [_record(20, 0)]}
    assert _senders(choose_sources(20, intact, W)) == {0: 2, 1: 1, 2: 2, 3: 3}


def test_a_part_damaged_everywhere_falls_back_to_the_older_iteration(caplog):
    inventories = _inventories(10, 20)
    intact = _intact(inventories, damaged={(1, 20, 1), (3, 20, 1)})
    with caplog.at_level(logging.WARNING):
        assert choose_sources(20, intact, W) is None
        verified = []
        iteration, plan = _recover(inventories, {(1, 20, 1), (3, 20, 1)}, verified)
    assert "iteration 20" in caplog.text and "rank 1's part" in caplog.text
    assert verified == [(20, {3: [_record(20, 1)]})]  # its replica read, damaged too
    assert iteration == 10 and _senders(plan) == {r: r for r in range(W)}


def test_a_part_missing_everywhere_leaves_the_iteration_incomplete():
    inventories = _inventories(10, 20)
    for holder in (1, 3):
        inventories[holder] = [r for r in inventories[holder] if r.key != (20, 3)]
    assert complete_iterations(inventories, W) == [10]


def test_nothing_recoverable_means_the_persistent_checkpoint():
    inventories = _inventories(20)
    assert _recover(inventories, damaged={(0, 20, 2), (2, 20, 2)}) is None
    assert _recover([[] for _ in range(W)]) is None


def test_parts_of_another_job_are_ignored_with_one_line_naming_both_values(caplog):
    inventories = _inventories(10)
    other = LocalIdentity(world_size=W, replication_jump=2, replication_factor=2, run_id="old")
    for holder, clique in ((0, (0, 2)), (2, (0, 2)), (1, (1, 3)), (3, (1, 3))):
        inventories[holder] += [_record(20, owner, other) for owner in clique]
    with caplog.at_level(logging.WARNING):
        kept = matching_identity(inventories, IDENTITY)
    assert kept == _inventories(10)
    assert len(caplog.records) == 1
    assert "8 local checkpoint part(s)" in caplog.text and "run_id: 'job' != 'old'" in caplog.text
    assert _recover(kept)[0] == 10


def test_the_lowest_intact_holder_sends_when_the_owners_copy_is_gone():
    """F = 3 on 6 ranks: cliques (0, 2, 4) and (1, 3, 5); rank 0's node is lost."""
    intact = [set(), {(5, 1)}, {(5, 0), (5, 2)}, {(5, 3)}, {(5, 0), (5, 4)}, {(5, 5)}]
    assert _senders(choose_sources(5, intact, 6)) == {0: 2, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5}


def test_an_owner_whose_own_copy_is_damaged_is_planned_from_the_verified_replica():
    inventories = _inventories(20)
    verified = []
    iteration, plan = _recover(inventories, damaged={(0, 20, 0)}, log=verified)
    assert verified == [(20, {2: [_record(20, 0)]})]
    assert iteration == 20 and _senders(plan) == {0: 2, 1: 1, 2: 2, 3: 3}


def test_every_own_part_intact_plans_without_reading_a_replica():
    inventories = _inventories(20)
    own = _own_parts(_intact(inventories))
    step = next_step(20, inventories, own, W, replicas_verified=False)
    assert step.verify == {} and _senders(step.plan) == {r: r for r in range(W)}


def test_ranks_that_disagree_on_the_identity_recover_nothing_and_say_why(caplog):
    assert agreed_identity([IDENTITY] * W) == IDENTITY
    with_algo = LocalIdentity(
        world_size=W, replication_jump=2, replication_factor=2, run_id="job", algo="atomic"
    )
    other_run = LocalIdentity(world_size=W, replication_jump=2, replication_factor=2, run_id="x")
    with caplog.at_level(logging.ERROR):
        assert agreed_identity([IDENTITY, with_algo, IDENTITY, other_run]) is None
    assert len(caplog.records) == 1
    text = caplog.text
    assert "rank 0: LocalIdentity(" in text and "rank 1: " in text and "algo='atomic'" in text
    assert "rank 3: " in text and "run_id='x'" in text and "rank 2: " not in text
