"""The coordination group: named, outside torch's group counter, one per default group."""

import socket

import pytest
import torch
import torch.distributed as dist

from megatron_async.core import coordination


def _init_one_rank_world() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


@pytest.fixture
def one_rank_world():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    _init_one_rank_world()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _group_name(group) -> str:
    return dist.distributed_c10d._world.pg_names[group]


def test_creating_it_leaves_the_names_of_later_groups_alone(one_rank_world):
    counter_before = dist.distributed_c10d._world.group_count
    group = coordination.get_coordination_group(30.0)
    assert dist.distributed_c10d._world.group_count == counter_before
    assert _group_name(group) == coordination.COORDINATION_GROUP_NAME
    assert coordination.get_coordination_group() is group
    assert coordination.all_reduce_max([3, 1], group) == [3, 1]
    assert coordination.all_gather_objects({"rank": 0}) == [{"rank": 0}]
    assert dist.get_rank(group) == 0 and dist.get_world_size(group) == 1


def test_a_new_default_group_gets_a_new_coordination_group(one_rank_world):
    first = coordination.get_coordination_group(30.0)
    dist.destroy_process_group()
    _init_one_rank_world()
    second = coordination.get_coordination_group(30.0)
    assert second is not first
    assert _group_name(second) == coordination.COORDINATION_GROUP_NAME
    assert coordination.all_reduce_max([1]) == [1]


def test_a_destroyed_group_is_replaced_under_another_name(one_rank_world):
    first = coordination.get_coordination_group(30.0)
    dist.destroy_process_group(first)
    second = coordination.get_coordination_group(30.0)
    assert second is not first
    assert _group_name(second) == coordination.COORDINATION_GROUP_NAME + "_1"
    tensor = torch.ones(1)
    dist.all_reduce(tensor, group=second)
    assert tensor.item() == 1
