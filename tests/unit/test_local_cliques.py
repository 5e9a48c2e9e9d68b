"""megatron_async.local.cliques: replication cliques, strategies and the imported names."""

import socket

import pytest
import torch.distributed as dist

from megatron_async.errors import CheckpointValidationError, LocalCheckpointError
from megatron_async.local.cliques import (
    CliqueReplicationStrategy,
    ExchangePlan,
    ExchangePlanEntry,
    GroupWrapper,
    LazyCliqueReplicationStrategy,
    ReplicationStrategy,
    batched,
    parse_group_sequence,
)


@pytest.mark.parametrize(
    "jump, factor, world_size, cliques",
    [
        (2, 2, 4, [(0, 2), (1, 3)]),
        (2, 2, 8, [(0, 2), (1, 3), (4, 6), (5, 7)]),
        (2, 3, 12, [(0, 2, 4), (1, 3, 5), (6, 8, 10), (7, 9, 11)]),
        (4, 1, 4, [(0,), (1,), (2,), (3,)]),
    ],
)
def test_cliques_take_one_rank_from_each_of_factor_nodes(jump, factor, world_size, cliques):
    assert parse_group_sequence(jump, factor, world_size) == cliques


def test_a_world_that_does_not_split_into_cliques_says_what_to_pass():
    expected = r"world size 6 .* 2 x 2.*--replication-jump"
    with pytest.raises(CheckpointValidationError, match=expected):
        parse_group_sequence(2, 2, 6)
    with pytest.raises(CheckpointValidationError, match="--replication-jump"):
        parse_group_sequence(0, 2, 4)
    with pytest.raises(CheckpointValidationError, match="--replication-factor"):
        parse_group_sequence(2, 0, 4)


def test_batched_cuts_consecutive_tuples():
    assert list(batched(range(5), 2)) == [(0, 1), (2, 3), (4,)]
    assert list(batched([], 3)) == []
    with pytest.raises(CheckpointValidationError):
        list(batched([1], 0))


def test_from_replication_params_picks_this_ranks_clique():
    strategy = CliqueReplicationStrategy.from_replication_params(2, 2, world_size=8, rank=5)
    assert isinstance(strategy, ReplicationStrategy)
    assert strategy.clique == (5, 7)
    assert (strategy.replication_jump, strategy.replication_factor) == (2, 2)
    assert strategy.peers(5) == (7,) and strategy.peers(7) == (5,)
    with pytest.raises(LocalCheckpointError, match="not in the replication clique"):
        strategy.peers(4)


def test_the_jump_defaults_to_the_ranks_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    strategy = CliqueReplicationStrategy.from_replication_params(world_size=4, rank=1)
    assert strategy.clique == (1, 3) and strategy.replication_jump == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    expected = "LOCAL_WORLD_SIZE is not set.*--replication-jump"
    with pytest.raises(CheckpointValidationError, match=expected):
        CliqueReplicationStrategy.from_replication_params(world_size=4, rank=1)


def test_without_a_process_group_the_world_must_be_given():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(LocalCheckpointError, match="init_process_group"):
        CliqueReplicationStrategy.from_replication_params(2, 2)


def test_a_strategy_from_explicit_ranks_derives_its_layout():
    strategy = CliqueReplicationStrategy([6, 2, 4])
    assert strategy.clique == (2, 4, 6)
    assert (strategy.replication_jump, strategy.replication_factor) == (2, 3)
    with pytest.raises(CheckpointValidationError, match="distinct"):
        CliqueReplicationStrategy([1, 1])


def test_the_lazy_strategy_is_built_on_first_use(monkeypatch):
    built = []

    def build(cls, jump=None, factor=2, **kwargs):
        built.append((jump, factor))
        return CliqueReplicationStrategy([0, 2])

    monkeypatch.setattr(CliqueReplicationStrategy, "from_replication_params", classmethod(build))
    lazy = LazyCliqueReplicationStrategy(2, 2)
    assert built == []
    assert lazy.peers(0) == (2,) and lazy.peers(2) == (0,)
    assert built == [(2, 2)]


def test_an_exchange_plan_lists_what_each_rank_reads_and_receives():
    plan = ExchangePlan()
    plan.plan(0, 0, (7, 0))
    plan.plan(0, 2, (7, 2))
    plan.plan(3, 3, (7, 3))
    assert plan.entries[1] == ExchangePlanEntry(sender=0, receiver=2, id_=(7, 2))
    assert plan.required_ids(0) == [(7, 0), (7, 2)]
    assert plan.received_by(2) == [ExchangePlanEntry(0, 2, (7, 2))]
    assert plan == ExchangePlan(plan.entries)


@pytest.fixture
def one_rank_world():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_group_wrapper_answers_rank_questions_and_gathers(one_rank_world):
    world = GroupWrapper()
    assert world.ranks == [0] and world.world_size == 1
    assert (world.my_group_rank, world.my_global_rank) == (0, 0)
    assert world.get_group_rank(0) == 0 and world.get_global_rank(0) == 0
    assert world.all_gather_object({"ids": [1]}) == [{"ids": [1]}]
    assert GroupWrapper.wrap(world) is world
    group = dist.new_group([0])
    assert GroupWrapper.from_list_of_groups([group]).group is group
    with pytest.raises(LocalCheckpointError, match="belongs to 2"):
        GroupWrapper.from_list_of_groups([group, dist.new_group([0])])
    assert CliqueReplicationStrategy(group).clique == (0,)
    assert CliqueReplicationStrategy.from_replication_params(1, 1).clique == (0,)
