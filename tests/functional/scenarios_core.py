"""Multi-rank scenarios for the async core; run by test_async_core_multirank.py.

Every rank runs every scenario; the last rank plays the odd one out (slow, failing,
dying or hanging) so that the others prove they learn about it.
"""

import functools
import os
import signal
import time

import torch

from megatron_async.core import AsyncCallerConfig, AsyncCallsQueue, AsyncRequest, worker_process
from megatron_async.errors import AsyncSaveFailedError
from megatron_async.torch_ckpt import TorchAsyncCheckpoint
from tests import background_fns as fns
from tests.persistent_worker import wait_until_worker_ready
from tests.functional.harness import (
    RankContext,
    by_name,
    for_both_callers,
    only_selected,
    run_scenarios,
    with_caller,
)


def _queue(persistent: bool, **config) -> AsyncCallsQueue:
    return wait_until_worker_ready(AsyncCallsQueue(persistent=persistent, config=AsyncCallerConfig(**config)))


def _path(ctx: RankContext, name: str) -> str:
    return os.path.join(ctx.tmp_dir, f"{name}-rank{ctx.rank}")


def _is_odd_one(ctx: RankContext) -> bool:
    return ctx.rank == ctx.world_size - 1


def finalize_waits_for_every_rank(ctx, persistent):
    queue = _queue(persistent)
    finalized = []
    release = os.path.join(ctx.tmp_dir, f"release-{persistent}")
    if _is_odd_one(ctx):  # its write cannot finish before the checks below are done
        request = AsyncRequest(fns.write_after_release, (_path(ctx, "slow"), None, release), [])
    else:
        request = AsyncRequest(fns.write_text, (_path(ctx, "slow"), None, "x"), [])
    request.add_finalize_fn(lambda: finalized.append(ctx.rank))
    queue.schedule_async_request(request)
    early = []
    for _ in range(5):  # same number of checks on every rank: each is one collective
        early += queue.maybe_finalize_async_calls(blocking=False)
        time.sleep(0.05)
    assert early == [], f"finalized {early} while the last rank was still writing"
    assert finalized == []
    if _is_odd_one(ctx):
        open(release, "w").close()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert finalized == [ctx.rank]
    queue.close()


def _expect_failure_everywhere(ctx, queue, odd_request, phase, text):
    normal = AsyncRequest(fns.write_text, (_path(ctx, "ok"), None, "x"), [])
    queue.schedule_async_request(odd_request if _is_odd_one(ctx) else normal)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except AsyncSaveFailedError as exc:
        odd = ctx.world_size - 1
        assert set(exc.failures) == {odd}, exc.failures
        assert exc.rank_failures[odd].phase == phase, exc.rank_failures[odd]
        assert text in exc.rank_failures[odd].message, exc.rank_failures[odd]
    else:
        raise AssertionError("no AsyncSaveFailedError on this rank")
    # The queue serves the next save on every rank.
    queue.schedule_async_request(AsyncRequest(fns.write_text, (_path(ctx, "next"), None, "y"), []))
    assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    queue.close()


def write_error_on_one_rank(ctx, persistent):
    request = AsyncRequest(fns.raise_error, (_path(ctx, "bad"), None, "quota exceeded"), [])
    _expect_failure_everywhere(ctx, _queue(persistent), request, "write", "quota exceeded")


def staging_error_on_one_rank(ctx, persistent):
    request = AsyncRequest(
        fns.write_text, (_path(ctx, "bad"), None, "x"), [],
        preload_fn=functools.partial(fns.stage_fails, "pinned alloc failed"),
    )
    _expect_failure_everywhere(ctx, _queue(persistent), request, "staging", "pinned alloc failed")


def worker_killed_on_one_rank(ctx, persistent):
    request = AsyncRequest(fns.kill_self, (_path(ctx, "bad"), None, None), [])
    _expect_failure_everywhere(ctx, _queue(persistent), request, "worker", "killed by signal 9")


def hung_writer_on_one_rank(ctx, persistent):
    request = AsyncRequest(fns.record_pid_and_hang, (_path(ctx, "pid"), None, 600.0), [])
    _expect_failure_everywhere(ctx, _queue(persistent, timeout_s=3.0), request, "timeout", "timeout_s=3")


def calls_in_flight_finalize_in_order(ctx, persistent):
    queue = _queue(persistent)
    order = []
    for i, delay in enumerate([0.6, 0.0, 0.3]):
        queue.schedule_async_request(
            AsyncRequest(fns.sleep_then_write, (_path(ctx, f"c{i}"), None, delay), [functools.partial(order.append, i)])
        )
    assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1, 2]
    assert order == [0, 1, 2]
    queue.close()


def torch_async_checkpoint_snapshot(ctx, persistent):
    ckpt = TorchAsyncCheckpoint(persistent_queue=persistent)
    weights = torch.full((256,), float(ctx.rank))
    ckpt.async_save({"w": weights, "step": 3}, _path(ctx, "model.pt"))
    weights.add_(1000.0)  # the optimizer step right after scheduling
    ckpt.finalize_async_save(blocking=True, no_dist=False)
    loaded = torch.load(_path(ctx, "model.pt"))
    assert loaded["step"] == 3 and torch.equal(loaded["w"], torch.full((256,), float(ctx.rank)))
    ckpt.close()


def _fork_fails(options):
    raise OSError(11, "simulated: Resource temporarily unavailable")


def worker_fork_fails_on_one_rank(ctx):
    """The last rank's worker died and forking its replacement fails: the save fails on
    every rank with that rank's typed error, and the next save forks a working worker."""
    queue = _queue(True)
    caller = queue.persistent_caller
    if _is_odd_one(ctx):
        os.kill(caller.process.pid, signal.SIGKILL)
        caller.process.join(timeout=30)
        assert caller.process.exitcode == -signal.SIGKILL
        worker_process.fork_worker, real_fork = _fork_fails, worker_process.fork_worker
    try:
        request = AsyncRequest(fns.write_text, (_path(ctx, "bad"), None, "x"), [])
        queue.schedule_async_request(request)
        try:
            queue.maybe_finalize_async_calls(blocking=True)
        except AsyncSaveFailedError as exc:
            odd = ctx.world_size - 1
            assert set(exc.failures) == {odd}, exc.failures
            assert exc.rank_failures[odd].phase == "schedule", exc.rank_failures[odd]
            assert "cannot fork the persistent checkpoint worker" in exc.rank_failures[odd].message
        else:
            raise AssertionError("no AsyncSaveFailedError on this rank")
    finally:
        if _is_odd_one(ctx):
            worker_process.fork_worker = real_fork
    queue.schedule_async_request(AsyncRequest(fns.write_text, (_path(ctx, "next"), None, "y"), []))
    assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    with open(_path(ctx, "next")) as f:
        assert f.read() == "y"
    queue.close()


def our_request_runs_through_megatron_execute_sync(ctx):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest as McoreRequest

    finalized = []
    ours = AsyncRequest(
        fns.write_text, (_path(ctx, "mc"), None, "ours"), [lambda: finalized.append(1)],
        preload_fn=functools.partial(str, "staged"),
    )
    McoreRequest(*ours).execute_sync()
    with open(_path(ctx, "mc")) as f:
        assert f.read() == "ours:staged"
    assert finalized == [1]


def megatron_queue_fails_on_cpu_only_torch(ctx):
    """The reference queue needs CUDA even for a CPU job (the trap this project avoids)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as McoreQueue

    if torch.cuda.is_available():
        return "skipped: CUDA present"
    request = AsyncRequest(fns.write_text, (_path(ctx, "ref"), None, "x"), [])
    try:
        McoreQueue().schedule_async_request(request)
    except (AssertionError, RuntimeError) as exc:
        return f"fails as expected: {type(exc).__name__}"
    raise AssertionError("megatron-core's queue unexpectedly ran on CPU-only torch")


def our_request_on_megatron_queue(ctx):
    """Our request on megatron-core's own queue, with its CUDA-only calls stubbed out.

    megatron-core's queue calls ``torch.cuda.synchronize`` and allocates its finalize
    all-reduce tensor on ``torch.cuda.current_device()``; on CPU-only torch both are
    stubbed (here only) so that the field-level compatibility can be checked.
    """
    from unittest import mock

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as McoreQueue

    finalized = []
    ours = AsyncRequest(
        fns.write_text, (_path(ctx, "onmc"), None, "ours"), [lambda: finalized.append(1)],
        preload_fn=functools.partial(str, "staged"),
    )
    with mock.patch("torch.cuda.synchronize", lambda *a, **k: None), mock.patch(
        "torch.cuda.current_device", lambda: "cpu"
    ):
        queue = McoreQueue(persistent=False)
        assert queue.schedule_async_request(ours) == 0
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    with open(_path(ctx, "onmc")) as f:
        assert f.read() == "ours:staged"
    assert finalized == [1]


def foreign_request_with_nothing_to_write_on_one_rank(ctx, persistent):
    """A request built the megatron-core way (its AsyncRequest class, from the writer's
    ``get_save_function_and_args()``), on a rank with nothing to write: ``(None, None,
    None)`` becomes ``AsyncRequest(None, None, [finalize], preload_fn=None)``. It must run
    on our queue like any other, and the checkpoint must hold the other ranks' data."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest as McoreRequest

    from megatron_async.filesystem_async import FileSystemWriterAsync
    from megatron_async.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    directory = os.path.join(ctx.tmp_dir, f"foreign-{persistent}")
    if ctx.rank == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    state = {} if _is_odd_one(ctx) else {f"t{ctx.rank}": torch.full((8,), float(ctx.rank))}
    queue = _queue(persistent)
    planned, *_ = save_state_dict_async_plan(state, FileSystemWriterAsync(directory))
    save_fn, preload_fn, save_args = planned[0].get_save_function_and_args()
    assert (save_fn is None) == _is_odd_one(ctx)
    request = McoreRequest(
        save_fn, save_args, [functools.partial(save_state_dict_async_finalize, *planned)],
        preload_fn=preload_fn,
    )
    assert queue.schedule_async_request(request) == 0
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    queue.close()
    expected = {f"t{r}": torch.full((8,), float(r)) for r in range(ctx.world_size - 1)}
    loaded = {name: torch.zeros(8) for name in expected}
    dcp.load(loaded, checkpoint_id=directory, no_dist=True)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


SCENARIOS = {
    # Both callers: how a background call fails, hangs, is waited for and ordered differs
    # by caller (a process per call, or one worker that runs the calls in turn).
    **for_both_callers(
        finalize_waits_for_every_rank,
        write_error_on_one_rank,
        worker_killed_on_one_rank,
        hung_writer_on_one_rank,
        calls_in_flight_finalize_in_order,
    ),
    # One caller: staging and request building run in the trainer the same way for both.
    **with_caller("temporal", torch_async_checkpoint_snapshot),
    **with_caller("persistent", staging_error_on_one_rank, foreign_request_with_nothing_to_write_on_one_rank),
    **by_name(
        worker_fork_fails_on_one_rank,
        our_request_runs_through_megatron_execute_sync,
        megatron_queue_fails_on_cpu_only_torch,
        our_request_on_megatron_queue,
    ),
}

FOUR_RANK_SCENARIOS = [
    "finalize_waits_for_every_rank[persistent]",
    "write_error_on_one_rank[temporal]",
    "worker_killed_on_one_rank[persistent]",
    "foreign_request_with_nothing_to_write_on_one_rank[persistent]",
    "worker_fork_fails_on_one_rank",
]
"""The scenarios also run on 4 ranks: one rank that differs from several others."""


def run_all(ctx: RankContext):
    return run_scenarios(ctx, only_selected(ctx, SCENARIOS))
