"""The agreed-step helper: a step that fails on one rank raises the same error on all."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch.distributed as dist

from megatron_async.errors import CheckpointInProgressError, CheckpointValidationError
from megatron_async.core.coordination import agreed_step

pytestmark = pytest.mark.timeout(120)


def test_a_successful_step_returns_its_result_and_the_reduced_flags():
    result, flags = agreed_step("planning", lambda: "plan", flags=lambda r: [len(r), 0])
    assert result == "plan" and flags == [4, 0]
    assert agreed_step("planning", lambda: 7) == (7, [])


def test_a_failed_step_raises_a_validation_error_naming_the_step_with_the_cause():
    def step():
        raise RuntimeError("overlapping shards")

    with pytest.raises(CheckpointValidationError, match="planning failed on 1 rank") as info:
        agreed_step("planning", step)
    assert "rank 0: RuntimeError: overlapping shards" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_the_flags_see_none_after_a_failure_and_keep_their_length():
    seen = []

    def step():
        raise OSError("no space")

    with pytest.raises(CheckpointValidationError):
        agreed_step("writing", step, flags=lambda r: seen.append(r) or [1, 0])
    assert seen == [None]


def test_our_own_errors_read_as_they_are_and_a_bare_one_still_names_its_type():
    def ours():
        raise CheckpointValidationError("rank 0: checkpoint directory /x does not exist; create it")

    with pytest.raises(CheckpointValidationError) as info:
        agreed_step("target check", ours)
    assert "\n  rank 0: checkpoint directory /x does not exist; create it" in str(info.value)

    def bare():
        raise TypeError()

    with pytest.raises(CheckpointValidationError, match="rank 0: TypeError$"):
        agreed_step("planning", bare)


def test_a_save_still_in_flight_keeps_its_type():
    def step():
        raise CheckpointInProgressError("an earlier save is not finalized")

    with pytest.raises(CheckpointInProgressError, match="not finalized"):
        agreed_step("target check", step)


def test_an_interrupt_is_not_agreed_on_but_propagates():
    def step():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        agreed_step("planning", step)


def _rank_main(rank: int, store_path: str, outcomes) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        def step():
            if rank == 1:
                raise ValueError("shard missing on this rank")
            return rank

        try:
            agreed_step("local save planning", step, flags=lambda r: [0 if r is None else r])
            outcomes.put((rank, "no error"))
        except CheckpointValidationError as exc:
            outcomes.put((rank, str(exc)))
        result, flags = agreed_step("second step", lambda: rank, flags=lambda r: [r])
        outcomes.put((rank, f"then {result} {flags}"))
    finally:
        dist.destroy_process_group()


def test_a_failure_on_one_rank_raises_the_same_error_on_every_rank(tmp_path):
    # spawn, not fork: earlier tests leave threads (gloo's among them) in this process,
    # and a fork of a threaded process can inherit a lock some thread held.
    ctx = mp.get_context("spawn")
    outcomes = ctx.Queue()
    store = os.path.join(tmp_path, "store")
    procs = [ctx.Process(target=_rank_main, args=(r, store, outcomes)) for r in range(2)]
    for proc in procs:
        proc.start()
    got = sorted(outcomes.get(timeout=90) for _ in range(4))
    for proc in procs:
        proc.join(timeout=30)
    errors = {rank: text for rank, text in got if not text.startswith("then")}
    assert errors[0] == errors[1], errors
    assert "local save planning failed on 1 rank(s)" in errors[0]
    assert "rank 1: ValueError: shard missing on this rank" in errors[0]
    # The ranks stay in step: the next agreed step reduces every rank's flags.
    assert sorted(text for _, text in got if text.startswith("then")) == ["then 0 [1]", "then 1 [1]"]
