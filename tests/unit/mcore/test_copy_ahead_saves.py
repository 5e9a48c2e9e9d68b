"""With the copy ahead turned on, warm saves copy CPU tensors ahead of their checks, and each
checkpoint holds its own save's values (one rank; read back through megatron-core and
through PyTorch DCP)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from megatron_async.errors import CheckpointValidationError
from megatron_async.mcore import strategy as strategy_module
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy
from megatron_async.staging import buffers
from megatron_async.staging.copy_ahead import COPY_AHEAD_ENV
from megatron_async.staging.copy_pool import COPY_THREADS_ENV
from megatron_async.staging.flat_copy import FlatCopy

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_rank_group")]


class _Run:
    """Parameters updated in place between saves, as in training; a strategy configured as
    Megatron-LM's ``--ckpt-assume-constant-structure`` configures it."""

    def __init__(self, tmp_path, monkeypatch, extra: bool = False):
        self.tmp_path = tmp_path
        self.params = {f"p{i}": torch.rand(64, 32) for i in range(6)}
        self.strategy = TorchDistAsyncSaveStrategy()
        self.strategy.use_cached_ckpt_structure = True
        self.saves = 0
        self.aheads = []  # per staging: (copy ahead given, claimed, copied at staging)
        original, original_copy = buffers.stage_buckets, FlatCopy.copy
        copies = []

        def spy(*args, **kwargs):
            ahead = kwargs.get("copy_ahead")
            copies.clear()
            try:
                return original(*args, **kwargs)
            finally:
                claimed = ahead is not None and ahead.claimed
                self.aheads.append((ahead is not None, claimed, bool(copies)))

        def counted_copy(flat):
            copies.append(flat)
            return original_copy(flat)

        monkeypatch.setattr(buffers, "stage_buckets", spy)
        monkeypatch.setattr(FlatCopy, "copy", counted_copy)
        monkeypatch.setenv(COPY_AHEAD_ENV, "1")
        monkeypatch.setenv(COPY_THREADS_ENV, "2")  # one copy thread beside the training thread

    def state(self, extra=False):
        state = {key: ShardedTensor.from_rank_offsets(key, value) for key, value in self.params.items()}
        if extra:
            state["extra"] = ShardedTensor.from_rank_offsets("extra", torch.ones(3))
        return state

    def save(self, extra=False, directory=None):
        path = directory or str(self.tmp_path / f"save{self.saves}")
        os.makedirs(path, exist_ok=True)
        self.saves += 1
        expected = {key: value.clone() for key, value in self.params.items()}
        request = dist_checkpointing.save(
            self.state(extra), path, sharded_strategy=self.strategy, async_sharded_save=True,
            validate_access_integrity=self.saves == 1)
        request.execute_sync()
        with torch.no_grad():  # the next training step, in place
            for value in self.params.values():
                value.mul_(1.5).add_(1)
        self.check(path, expected)
        return path

    @staticmethod
    def check(path, expected):
        loaded = dist_checkpointing.load(
            {key: ShardedTensor.from_rank_offsets(key, torch.zeros_like(value))
             for key, value in expected.items()}, path)
        plain = {key: torch.zeros_like(value) for key, value in expected.items()}
        dcp.load(plain, checkpoint_id=path)
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key
            assert torch.equal(plain[key], value), key


def test_warm_saves_stage_through_the_copy_ahead(tmp_path, monkeypatch):
    run = _Run(tmp_path, monkeypatch)
    for _ in range(4):
        run.save()
    # the first save plans and builds the one-call copies (copied at staging); from the
    # second on, the copy started before the checks is the one staged
    assert run.aheads == [(False, False, True)] + [(True, True, False)] * 3
    assert run.strategy.structure_reuse_count == 3


def test_a_structure_change_or_a_failed_save_cancels_it(tmp_path, monkeypatch):
    run = _Run(tmp_path, monkeypatch)
    for _ in range(2):
        run.save()
    run.save(extra=True)  # planned in full: the copy ahead is cancelled, not handed over
    assert run.aheads[-1] == (False, False, True)
    run.save(extra=True)
    assert run.aheads[-1] == (True, True, False)
    # A save that fails in the strategy's checks cancels the copy ahead it started; the
    # next save leases the buffers again.
    def fail(*args):
        raise CheckpointValidationError("refused for the test")

    path = str(tmp_path / "refused")
    os.makedirs(path)
    with monkeypatch.context() as patch:
        patch.setattr(strategy_module, "claim_save_target", fail)
        with pytest.raises(CheckpointValidationError, match="refused for the test"):
            dist_checkpointing.save(run.state(extra=True), path, sharded_strategy=run.strategy,
                                    async_sharded_save=True, validate_access_integrity=False)
    assert run.strategy.staging_cache.unclaimed_aheads() == []
    run.save(extra=True)
    assert run.aheads[-1] == (True, True, False)


def test_a_request_scheduled_after_a_training_step_holds_the_values_it_staged(tmp_path, monkeypatch):
    # megatron-core stages when the request is scheduled: a request run after the
    # tensors changed in place holds the new values, copied anew, not the copy ahead's.
    run = _Run(tmp_path, monkeypatch)
    for _ in range(2):
        run.save()
    path = str(tmp_path / "late")
    os.makedirs(path)
    request = dist_checkpointing.save(run.state(), path, sharded_strategy=run.strategy,
                                      async_sharded_save=True, validate_access_integrity=False)
    with torch.no_grad():
        for value in run.params.values():
            value.add_(7)
    expected = {key: value.clone() for key, value in run.params.items()}
    request.execute_sync()
    run.check(path, expected)
    assert run.aheads[-1] == (True, True, True)
