"""Fixtures of the strategy's single-process tests."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-rank gloo job for the tests of one module (the strategy's saves need one)."""
    store = tmp_path_factory.mktemp("store") / "init"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
