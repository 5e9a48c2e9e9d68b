"""Staging within a memory budget on real gloo jobs (both callers): a 64 MiB-per-rank state
saved under a 16 MiB budget loads back equal through megatron-core and DCP while the
staging memory sampled during the save stays within the budget; two saves in a row never
hold two copies; an in-place update after scheduling is not saved; a budget below the
largest tensor is refused on every rank with a message naming the tensor. With overlapped
staging, scheduling returns before any round is copied, the optimizer step waits for the
last round (its update is not saved), and an update that bypasses that wait fails the save
on every rank while the previous checkpoint stays whole; a writer killed while the copy
thread waits for it does not hold the optimizer step. The same budget for
``TorchAsyncCheckpoint`` (async ``torch.save``), whose files load back with ``torch.load``."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from megatron_async.core import AsyncCallsQueue, shared_memory
from megatron_async.errors import AsyncSaveFailedError, StagingHandOverError
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy
from megatron_async.staging.budget import StagingBufferCache, StagingLedger
from megatron_async.torch_ckpt import TorchAsyncCheckpoint
from tests.staging_aids import copies_held, staging_in_progress
from tests.functional.harness import RankContext, by_name, for_both_callers, run_selected_then_close
from tests.persistent_worker import wait_until_worker_ready
from tests.functional.scenarios_strategy import (
    FAILING_RANK,
    _dir,
    _load_dcp,
    expect_staging_race_everywhere,
)

MIB = 2**20
TENSORS, TENSOR_NUMEL = 16, MIB  # 16 float32 tensors of 4 MiB: 64 MiB per rank
BUDGET = 16 * MIB
SLACK = 1 * MIB
"""Control blocks of the saves in flight (a few KiB each)."""


def _state(ctx: RankContext, scale: float, params: bool = False):
    """This rank's 64 MiB; ``params``: as parameters an optimizer steps (tensors otherwise)."""
    r, ws = ctx.rank, ctx.world_size

    def value(i):
        data = torch.arange(TENSOR_NUMEL, dtype=torch.float32) * scale + i + 1000 * r
        return torch.nn.Parameter(data) if params else data

    return {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", value(i), (0, r, ws))
            for i in range(TENSORS)}


def _check(ctx, path, scale):
    expected = _state(ctx, scale)
    loaded = dist_checkpointing.load(_state(ctx, 0.0), path)
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor.data), ("megatron", key)
    whole = _load_dcp(path, ctx.world_size)
    for i in range(TENSORS):
        rows = [torch.arange(TENSOR_NUMEL, dtype=torch.float32) * scale + i + 1000 * r
                for r in range(ctx.world_size)]
        assert torch.equal(whole[f"w{i}"], torch.cat(rows)), ("dcp", i)


class _Sampler:
    """The most staging shared memory this trainer process held while it ran."""

    def __init__(self):
        StagingBufferCache.of_process().clear()  # staging memory of earlier scenarios: counted from zero
        StagingLedger.of_process().drop_pool()
        StagingLedger.of_process().peak_bytes = 0
        gc.collect()
        self.baseline = shared_memory.live_bytes()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, shared_memory.live_bytes() - self.baseline)
            self._stop.wait(0.0005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _within(sampler: _Sampler, limit: int) -> int:
    """Check the sampled staging memory (measured from what was alive before: a pool an
    earlier scenario left is reused) and the ledger's peak against ``limit``; return the peak."""
    assert sampler.peak <= limit + SLACK, (sampler.peak, limit)
    assert StagingLedger.of_process().peak_bytes == limit, StagingLedger.of_process().peak_bytes
    return sampler.peak


_QUEUES = {}


def _queue(persistent):
    if persistent not in _QUEUES:
        _QUEUES[persistent] = AsyncCallsQueue(persistent=persistent)
    return _QUEUES[persistent]


def _schedule(queue, ctx, path, strategy, scale, mutate=False):
    state = _state(ctx, scale)
    request = dist_checkpointing.save(state, path, sharded_strategy=strategy, async_sharded_save=True)
    queue.schedule_async_request(request)
    if mutate:  # the next training step, right after scheduling returned
        for value in state.values():
            value.data.add_(12345)


def large_state_saved_in_rounds_within_the_budget(ctx, persistent):
    strategy = TorchDistAsyncSaveStrategy(staging_memory_limit=BUDGET)
    queue = _queue(persistent)
    with _Sampler() as sampler:
        for step in range(2):  # the second save reuses the pool
            path = _dir(ctx, f"rounds-{persistent}-{step}")
            _schedule(queue, ctx, path, strategy, float(step + 1), mutate=True)
            queue.maybe_finalize_async_calls(blocking=True)
            _check(ctx, path, float(step + 1))
    return _within(sampler, BUDGET)


def two_saves_in_a_row_hold_one_copy(ctx, persistent):
    state_bytes = TENSORS * TENSOR_NUMEL * 4
    strategy = TorchDistAsyncSaveStrategy()  # default budget: one copy of the state
    queue = _queue(persistent)
    with _Sampler() as sampler:
        paths = [_dir(ctx, f"row-{persistent}-{i}") for i in range(2)]
        _schedule(queue, ctx, paths[0], strategy, 5.0)
        _schedule(queue, ctx, paths[1], strategy, 6.0)  # waits for the first writer
        queue.maybe_finalize_async_calls(blocking=True)
    _check(ctx, paths[0], 5.0)
    _check(ctx, paths[1], 6.0)
    return _within(sampler, state_bytes)


def budget_below_the_largest_tensor_is_refused(ctx, persistent):
    strategy = TorchDistAsyncSaveStrategy(staging_memory_limit=2 * MIB)
    path = _dir(ctx, f"refused-{persistent}")
    queue = _queue(persistent)
    _schedule(queue, ctx, path, strategy, 1.0)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except AsyncSaveFailedError as exc:
        message = str(exc)
    else:
        raise AssertionError("a budget below the largest tensor was not refused")
    assert "needs 4194304 bytes" in message and "at least 4194304" in message, message
    dist.barrier()


def _schedule_overlapped(queue, ctx, path, scale, before_copies=lambda: None):
    """Schedule an overlapped save above the budget; return the saved parameters.

    ``before_copies`` runs after scheduling returned, before the copy thread starts."""
    strategy = TorchDistAsyncSaveStrategy(staging_memory_limit=BUDGET, overlap_staging=True)
    state = _state(ctx, scale, params=True)
    request = dist_checkpointing.save(state, path, sharded_strategy=strategy, async_sharded_save=True)
    with copies_held():  # the copy thread starts no round before this block ends
        queue.schedule_async_request(request)
        assert staging_in_progress()  # scheduling returned with every round pending
        before_copies()
    return [value.data for value in state.values()]


def _step(params):
    """The next training step's optimizer step (it waits for the overlapped copies)."""
    optimizer = torch.optim.SGD(params, lr=1.0)
    for param in params:
        param.grad = torch.full_like(param, 12345.0)
    optimizer.step()


def overlapped_rounds_within_the_budget(ctx, persistent):
    """Overlapped staging above the budget: scheduling returns before any round is copied,
    the optimizer step waits for the last one, and its update is not saved."""
    queue = _queue(persistent)
    with _Sampler() as sampler:
        for step in range(2):  # the second save reuses the pool
            path = _dir(ctx, f"overlapped-rounds-{persistent}-{step}")
            params = _schedule_overlapped(queue, ctx, path, float(step + 1))
            _step(params)  # waits until the last round is copied
            assert not staging_in_progress()
            queue.maybe_finalize_async_calls(blocking=True)
            _check(ctx, path, float(step + 1))
            assert torch.equal(params[0].detach(), _state(ctx, float(step + 1))["w0"].data - 12345.0)
    assert sampler.peak <= BUDGET + SLACK, (sampler.peak, BUDGET)
    assert StagingLedger.of_process().peak_bytes == BUDGET, StagingLedger.of_process().peak_bytes
    return sampler.peak


def overlapped_rounds_unguarded_update_fails_everywhere(ctx, persistent):
    """An in-place update that bypasses the optimizer step's wait, on one rank, before its
    round is copied: the save fails on every rank with StagingRaceError naming the tensor,
    nothing marks it complete, and the previous checkpoint still loads equal."""
    queue = _queue(persistent)
    previous = _dir(ctx, f"overlapped-kept-{persistent}")
    _schedule(queue, ctx, previous, TorchDistAsyncSaveStrategy(
        staging_memory_limit=BUDGET, overlap_staging=True), 7.0)
    queue.maybe_finalize_async_calls(blocking=True)
    path = _dir(ctx, f"overlapped-race-{persistent}")
    strategy = TorchDistAsyncSaveStrategy(staging_memory_limit=BUDGET, overlap_staging=True)
    state = _state(ctx, 8.0)
    request = dist_checkpointing.save(state, path, sharded_strategy=strategy, async_sharded_save=True)
    with copies_held():
        queue.schedule_async_request(request)
        if ctx.rank == FAILING_RANK:
            state["w3"].data.add_(1.0)  # no optimizer step, no wait_for_staging()
    expect_staging_race_everywhere(queue, path, "w3")
    _check(ctx, previous, 7.0)


def overlapped_rounds_writer_killed_does_not_hold_the_step(ctx, persistent):
    """The writer of an overlapped save above the budget dies on one rank before the copy
    thread started: the copy thread stops once it finds the writer gone instead of waiting
    for it to free the pool (600 s), so the optimizer step returns; the save fails on every
    rank and nothing marks it complete."""
    queue = wait_until_worker_ready(_queue(persistent))
    path = _dir(ctx, f"overlapped-killed-{persistent}")

    def kill_writer():
        if ctx.rank != FAILING_RANK:
            return
        deadline = time.monotonic() + 60  # this rank's first file: it recorded its pid before
        while not any(name.startswith(f"__{ctx.rank}_") for name in os.listdir(path)):
            assert time.monotonic() < deadline, "the writer never opened its files"
            time.sleep(0.02)
        os.kill(queue.async_calls[-1].async_caller.process.pid, signal.SIGKILL)

    params = _schedule_overlapped(queue, ctx, path, 9.0, before_copies=kill_writer)
    _step(params)  # returns: a copy thread stuck on the dead writer would hold it
    assert not staging_in_progress()
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except AsyncSaveFailedError as exc:
        failures = dict(exc.rank_failures)
    else:
        raise AssertionError("a save whose writer was killed did not fail")
    assert set(failures) == {FAILING_RANK}, failures
    assert "signal 9" in failures[FAILING_RANK].message, failures
    dist.barrier()
    assert not set(os.listdir(path)) & {".metadata", "metadata.json"}
# -- TorchAsyncCheckpoint: the same budget for async torch.save files ------------------
def _torch_ckpt(persistent, limit):
    key = ("torch", persistent)  # closed with the launch's queues
    if key not in _QUEUES:
        _QUEUES[key] = TorchAsyncCheckpoint(persistent_queue=persistent)
        wait_until_worker_ready(_QUEUES[key]._queue)  # the saves reach the worker
    ckpt = _QUEUES[key]
    ckpt.staging_memory_limit = limit
    return ckpt


def _torch_state(ctx, scale):
    return {f"w{i}": torch.arange(TENSOR_NUMEL, dtype=torch.float32) * scale + i + 1000 * ctx.rank
            for i in range(TENSORS)}


def _torch_path(ctx, name):
    return os.path.join(_dir(ctx, "torch-save"), f"{name}-rank{ctx.rank}.pt")


def _check_torch_file(ctx, path, scale):
    loaded = torch.load(path, weights_only=True)
    expected = _torch_state(ctx, scale)
    assert loaded.keys() == expected.keys(), sorted(loaded)
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key


def torch_save_in_rounds_within_the_budget(ctx, persistent):
    ckpt = _torch_ckpt(persistent, BUDGET)
    with _Sampler() as sampler:
        for step in range(2):  # the second save reuses the pool
            path = _torch_path(ctx, f"rounds-{persistent}-{step}")
            state = _torch_state(ctx, float(step + 1))
            ckpt.async_save(state, path)
            assert ckpt.staging_stats == {"rounds": 4, "peak_bytes": BUDGET}, ckpt.staging_stats
            for tensor in state.values():  # the next training step, after async_save returned
                tensor.add_(12345)
            ckpt.finalize_async_save(blocking=True)
            _check_torch_file(ctx, path, float(step + 1))
    return _within(sampler, BUDGET)


def torch_saves_in_a_row_hold_one_copy(ctx, persistent):
    state_bytes = TENSORS * TENSOR_NUMEL * 4
    ckpt = _torch_ckpt(persistent, None)  # default budget: one copy of the saved tensors
    paths = [_torch_path(ctx, f"row-{persistent}-{i}") for i in range(2)]
    with _Sampler() as sampler:
        ckpt.async_save(_torch_state(ctx, 5.0), paths[0])
        ckpt.async_save(_torch_state(ctx, 6.0), paths[1])  # waits for the first writer
        ckpt.finalize_async_save(blocking=True, no_dist=False)
    _check_torch_file(ctx, paths[0], 5.0)
    _check_torch_file(ctx, paths[1], 6.0)
    return _within(sampler, state_bytes)


def torch_save_budget_below_the_largest_tensor_is_refused(ctx, persistent):
    ckpt = _torch_ckpt(persistent, 2 * MIB)
    path = _torch_path(ctx, f"refused-{persistent}")
    ckpt.async_save(_torch_state(ctx, 1.0), path)
    try:
        ckpt.finalize_async_save(blocking=True, no_dist=False)  # fails on every rank
    except AsyncSaveFailedError as exc:
        message = str(exc)
    else:
        raise AssertionError("a budget below the largest tensor was not refused")
    assert "tensor 'w0' alone needs 4194304 bytes" in message and "at least 4194304" in message, message
    assert not os.path.exists(path)
    dist.barrier()


def megatron_core_queue_refuses_what_it_cannot_finish(ctx):
    """megatron-core's own queue runs our strategy's one-go saves, but it never starts the
    copies that staging in rounds and overlapped staging leave for after the hand-over:
    scheduling either refuses at once with StagingHandOverError naming the fix, the
    refused checkpoint is not complete, and the one saved before loads equal.

    megatron-core's queue needs CUDA; its two CUDA calls are stubbed here, as in
    ``scenarios_core.our_request_on_megatron_queue``."""
    from unittest import mock

    try:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as McoreQueue
    except ImportError:
        return "skipped: this megatron-core has no AsyncCallsQueue"
    good = _dir(ctx, "mcore-queue-one-go")
    refused, held = {}, StagingLedger.of_process().held_bytes()
    with mock.patch("torch.cuda.synchronize", lambda *a, **k: None), mock.patch(
        "torch.cuda.current_device", lambda: "cpu"
    ):
        queue = McoreQueue(persistent=False)
        _schedule(queue, ctx, good, TorchDistAsyncSaveStrategy(), 3.0)
        queue.maybe_finalize_async_calls(blocking=True)
        for name, strategy in (
            ("rounds", TorchDistAsyncSaveStrategy(staging_memory_limit=BUDGET)),
            ("overlapped", TorchDistAsyncSaveStrategy(overlap_staging=True)),
        ):
            path = _dir(ctx, f"mcore-queue-{name}")
            started = time.monotonic()
            try:
                _schedule(queue, ctx, path, strategy, 4.0)
            except StagingHandOverError as exc:
                refused[name] = (str(exc), time.monotonic() - started)
            else:
                raise AssertionError(f"megatron-core's queue accepted {name} staging")
            dist.barrier()
            assert not os.path.exists(os.path.join(path, ".metadata")), name
    message, _ = refused["rounds"]
    assert "megatron_async.AsyncCallsQueue" in message, message
    assert f"at least {TENSORS * TENSOR_NUMEL * 4} bytes" in message, message
    assert "without overlap_staging" in refused["overlapped"][0], refused["overlapped"][0]
    assert all(elapsed < 30.0 for _, elapsed in refused.values()), refused
    assert StagingLedger.of_process().held_bytes() == held
    _check(ctx, good, 3.0)
    dist.barrier()


SCENARIOS = for_both_callers(
    large_state_saved_in_rounds_within_the_budget,
    two_saves_in_a_row_hold_one_copy,
    budget_below_the_largest_tensor_is_refused,
    torch_save_in_rounds_within_the_budget,
    torch_saves_in_a_row_hold_one_copy,
    torch_save_budget_below_the_largest_tensor_is_refused,
    overlapped_rounds_within_the_budget,
    overlapped_rounds_unguarded_update_fails_everywhere,
    overlapped_rounds_writer_killed_does_not_hold_the_step,  # last: kills a persistent worker
)
SCENARIOS.update(by_name(megatron_core_queue_refuses_what_it_cannot_finish))


def run_all(ctx: RankContext):
    return run_selected_then_close(ctx, SCENARIOS, _QUEUES)
