"""Fault injection on real multi-rank saves; run by test_faults.py.

Every scenario commits a good checkpoint (iteration 1) with the Megatron-style
:class:`CheckpointManager`, then injects one fault into the save of iteration 2 and
checks the guarantees: every rank raises a clear error, nothing marks iteration 2
complete, the tracker still names iteration 1, iteration 1 still loads, and no
background process is left behind. Rank 1 is the faulty rank unless said otherwise.
:func:`rank_stopped_during_finalize` is an entry point of its own (a launch per call).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import psutil
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from megatron_async import cli
from megatron_async.core import AsyncCallerConfig, AsyncCallsQueue, coordination
from megatron_async.core.save_directories import FileSystemStepTimeoutError, SaveDirectories
from megatron_async.errors import (
    AsyncSaveFailedError,
    CoordinationError,
    CheckpointInProgressError,
    CheckpointIntegrityError,
    CheckpointValidationError,
)
from megatron_async.writer.filesystem import FileSystemWriterAsync
from megatron_async.integrity.verify import verify_checkpoint_integrity
from megatron_async.checkpoint_dirs import is_complete_checkpoint, read_tracker
from megatron_async.manager import CheckpointManager, CheckpointManagerConfig
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy
from tests.functional.harness import (
    RankContext,
    by_name,
    for_both_callers,
    only_selected,
    run_scenarios,
    with_caller,
)
from tests.functional.scenarios_strategy import (
    _check_checkpoint,
    _dir,
    _expect_error_everywhere,
    _model_state,
    _save_async,
)
from tests.persistent_worker import wait_until_worker_ready

FAULTY_RANK = 1
_MARKERS = (".metadata", "metadata.json")


def _rank() -> int:
    return int(os.environ["RANK"])


# -- fake writers (module level: the persistent worker unpickles them by name) --------------


class _PlanningFailsWriter(FileSystemWriterAsync):
    def prepare_local_plan(self, plan):
        if _rank() == FAULTY_RANK:
            raise RuntimeError("planning exploded (injected)")
        return super().prepare_local_plan(plan)


class _StagingFailsWriter(FileSystemWriterAsync):
    @staticmethod
    def preload_tensors(resolved_plan_data, non_blocking=True):  # the reference signature
        if _rank() == FAULTY_RANK:
            raise MemoryError("cannot allocate staging buffers (injected)")
        return FileSystemWriterAsync.preload_tensors(resolved_plan_data, non_blocking)


class _WriteFailsWriter(FileSystemWriterAsync):
    @staticmethod
    def write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs):
        if _rank() == FAULTY_RANK:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return FileSystemWriterAsync.write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs)


class _FinishFailsWriter(FileSystemWriterAsync):
    """The coordinator (rank 0) cannot write the metadata."""

    def finish(self, metadata, results):
        raise OSError(errno.EDQUOT, "Disk quota exceeded writing .metadata (injected)")


_MOUNT_RECOVERED = threading.Event()
"""Set when the hung mount of :class:`_HangingFinishWriter` answers again."""


class _HungMount:
    """A checkpoint storage whose ``.metadata`` write waits for :data:`_MOUNT_RECOVERED`."""

    def __init__(self, storage):
        self._storage = storage

    def __getattr__(self, name):
        return getattr(self._storage, name)

    def write_atomically(self, path, data):
        assert _MOUNT_RECOVERED.wait(120), "the hung mount never recovered"
        return self._storage.write_atomically(path, data)


class _HangingFinishWriter(FileSystemWriterAsync):
    """The coordinator's ``.metadata`` write does not return (a hung network mount) until
    :data:`_MOUNT_RECOVERED` is set; then it completes."""

    def finish(self, metadata, results):
        from megatron_async.writer import commit

        original = commit.storage_for
        commit.storage_for = lambda path: _HungMount(original(path))
        try:
            return super().finish(metadata, results)
        finally:
            commit.storage_for = original


class _SlowWriter(FileSystemWriterAsync):
    """Waits before writing; marks that the write started (mid-write faults hit then)."""

    @staticmethod
    def write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs):
        with open(bucket.file_path + ".started", "w"):
            pass
        time.sleep(float(os.environ.get("FAULT_WRITE_DELAY_S", "1.5")))
        return FileSystemWriterAsync.write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs)


class _FrozenWriter(FileSystemWriterAsync):
    @staticmethod
    def write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs):
        if _rank() == FAULTY_RANK:
            time.sleep(600)
        return FileSystemWriterAsync.write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs)


class _FileSizeLimitedWriter(FileSystemWriterAsync):
    """A full disk where no tmpfs can be mounted: a tiny RLIMIT_FSIZE while writing."""

    @staticmethod
    def write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs):
        import resource

        if _rank() != FAULTY_RANK:
            return FileSystemWriterAsync.write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs)
        previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        previous = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, previous[1]))
        try:
            return FileSystemWriterAsync.write_preloaded_data(transform_list, open_file, idx, bucket, results_queue, count_queue, use_fsync, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, previous)
            signal.signal(signal.SIGXFSZ, previous_handler)


class _Strategy(TorchDistAsyncSaveStrategy):
    def __init__(self, writer_cls=FileSystemWriterAsync, **options):
        super().__init__(**options)
        self._writer_cls = writer_cls

    def _create_writer(self, checkpoint_dir):
        return self._writer_cls(checkpoint_dir, thread_count=self.config.thread_count)


# -- the round every scenario runs -------------------------------------------------------

_QUEUES = {}


def _queue(persistent: bool, **config) -> AsyncCallsQueue:
    key = (persistent, tuple(sorted(config.items())))
    if key not in _QUEUES:
        _QUEUES[key] = AsyncCallsQueue(persistent=persistent, config=AsyncCallerConfig(**config))
    return _QUEUES[key]


def _big_state(ctx: RankContext, scale: float):
    """About 96 KiB per rank: big enough to fill a small tmpfs in two saves."""
    data = torch.full((24 * 1024,), float(scale))
    return {"big": ShardedTensor.from_rank_offsets("big", data, (0, ctx.rank, ctx.world_size))}


def _managed_save(ctx, manager, queue, strategy, iteration, state, before_schedule=None, after_schedule=None):
    path = manager.prepare_save(iteration)
    if before_schedule is not None:
        before_schedule(ctx, path)
    request = dist_checkpointing.save(state, path, sharded_strategy=strategy, async_sharded_save=True)
    manager.attach_commit(request, iteration)
    queue.schedule_async_request(request)
    if after_schedule is not None:
        after_schedule(ctx, path)
    queue.maybe_finalize_async_calls(blocking=True)
    return path


def _allowed_children():
    allowed = set()
    for queue in _QUEUES.values():
        caller = queue.persistent_caller
        if caller is not None and caller.process is not None:
            allowed.add(caller.process.pid)
    return allowed


def _assert_no_process_left_behind():
    deadline = time.monotonic() + 10
    while True:
        leftovers = [
            (p.pid, p.name(), p.status())
            for p in psutil.Process().children(recursive=True)
            if p.pid not in _allowed_children()
        ]
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not leftovers, f"background processes left behind: {leftovers}"


def _fault_round(
    ctx,
    name,
    queue,
    fault_strategy,
    expected_error=AsyncSaveFailedError,
    state_fn=_model_state,
    save_dir=None,
    before_schedule=None,
    after_schedule=None,
    data_complete=False,
):
    """Commit iteration 1, fail iteration 2 with the fault, check every guarantee.

    ``data_complete``: the fault hits after the data and ``.metadata`` are written (at
    megatron's ``metadata.json`` step), so only "not complete" can be checked there.
    """
    save_dir = save_dir or _dir(ctx, name)
    manager = CheckpointManager(CheckpointManagerConfig(save_dir=save_dir, load_dir=save_dir))
    _managed_save(ctx, manager, queue, TorchDistAsyncSaveStrategy(), 1, state_fn(ctx, 1.0))
    assert read_tracker(save_dir) == 1
    caught = None
    started = time.monotonic()
    try:
        _managed_save(
            ctx, manager, queue, fault_strategy, 2, state_fn(ctx, 2.0), before_schedule, after_schedule
        )
    except expected_error as exc:
        caught = exc
    elapsed = time.monotonic() - started
    assert caught is not None, f"no {expected_error.__name__} on rank {ctx.rank}"
    dist.barrier()
    failed_path = manager.checkpoint_path(2)
    assert not is_complete_checkpoint(failed_path), "a failed save looks complete"
    for marker in _MARKERS[int(data_complete):]:
        assert not os.path.isfile(os.path.join(failed_path, marker)), f"{marker} marks a failed save complete"
    assert read_tracker(save_dir) == 1, "the tracker advanced past a failed save"
    good = manager.checkpoint_path(1)
    if state_fn is _model_state:
        _check_checkpoint(ctx, good, 1.0)
    else:
        loaded = dist_checkpointing.load(state_fn(ctx, 0.0), good)
        assert torch.equal(loaded["big"], torch.full((24 * 1024,), 1.0))
    resume = manager.find_resume_point()
    assert resume is not None and resume.iteration == 1, resume
    _assert_no_process_left_behind()
    summary = {"error": type(caught).__name__, "seconds": round(elapsed, 2)}
    if isinstance(caught, AsyncSaveFailedError):
        summary["failures"] = {r: (f.phase, f.message[:120]) for r, f in caught.rank_failures.items()}
        # Each failing rank's line of the message that every rank raises.
        lines = str(caught).splitlines()
        summary["lines"] = [line.strip()[:200] for line in lines if line.startswith("  rank ")]
    else:
        summary["message"] = str(caught)[:300]
    return summary


def _expect_phase(summary, rank, phase, text=""):
    failures = summary.get("failures", {})
    assert rank in failures, summary
    assert failures[rank][0] == phase and text in failures[rank][1], summary
    if phase in ("write", "worker", "timeout"):  # megatron-core's wording, which alerts grep for
        prefix = f"rank {rank} [{phase}] Worker failure: "
        assert any(line.startswith(prefix) for line in summary["lines"]), summary
    return summary


# -- scenarios -----------------------------------------------------------------------------


def disk_full(ctx, persistent):
    """A real full disk (a small tmpfs, as root) or, elsewhere, a file-size limit."""
    base = _dir(ctx, f"diskfull-{persistent}")
    mount_point = os.path.join(base, "tmpfs")
    mounted = 0
    if ctx.rank == 0:
        os.makedirs(mount_point, exist_ok=True)
        if os.geteuid() == 0 and shutil.which("mount"):
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", mount_point], capture_output=True)
            mounted = int(done.returncode == 0)
    flag = torch.tensor([mounted])
    dist.broadcast(flag, 0)
    try:
        if flag.item():
            summary = _fault_round(
                ctx, "diskfull", _queue(persistent), TorchDistAsyncSaveStrategy(),
                state_fn=_big_state, save_dir=mount_point,
            )
            assert any("No space left" in m for _, m in summary["failures"].values()), summary
            summary["how"] = "tmpfs"
        else:
            summary = _fault_round(
                ctx, f"diskfull-rlimit-{persistent}", _queue(persistent), _Strategy(_FileSizeLimitedWriter),
                state_fn=_big_state,
            )
            _expect_phase(summary, FAULTY_RANK, "write", "File too large")
            summary["how"] = "RLIMIT_FSIZE"
    finally:
        dist.barrier()
        if ctx.rank == 0 and flag.item():
            subprocess.run(["umount", "-l", mount_point], check=False)
    return summary


def exception_while_planning(ctx):
    summary = _fault_round(
        ctx, "plan", _queue(False), _Strategy(_PlanningFailsWriter), expected_error=CheckpointValidationError
    )
    assert "planning exploded" in summary["message"] and f"rank {FAULTY_RANK}" in summary["message"], summary
    return summary


def exception_while_staging(ctx, persistent):
    summary = _fault_round(ctx, f"stage-{persistent}", _queue(persistent), _Strategy(_StagingFailsWriter))
    return _expect_phase(summary, FAULTY_RANK, "staging", "cannot allocate staging buffers")


def exception_while_writing(ctx, persistent):
    summary = _fault_round(ctx, f"write-{persistent}", _queue(persistent), _Strategy(_WriteFailsWriter))
    return _expect_phase(summary, FAULTY_RANK, "write", "Input/output error")


def exception_while_finalizing(ctx):
    summary = _fault_round(ctx, "finalize", _queue(False), _Strategy(_FinishFailsWriter))
    return _expect_phase(summary, 0, "finalize", "Disk quota exceeded")


def metadata_json_cannot_be_written(ctx):
    """megatron's metadata.json step fails on rank 0: every rank raises, nobody waits."""

    def block_metadata_json(ctx, path):
        if ctx.rank == 0:
            os.makedirs(os.path.join(path, "metadata.json"))

    summary = _fault_round(
        ctx, "mdjson", _queue(False), TorchDistAsyncSaveStrategy(),
        after_schedule=block_metadata_json, data_complete=True,
    )
    _expect_phase(summary, 0, "finalize", "Is a directory")
    assert summary["seconds"] < 60, summary
    return summary


def _wait_for_started_write(path):
    deadline = time.monotonic() + 60
    while not any(n.endswith(".started") for n in os.listdir(path)):
        assert time.monotonic() < deadline, "the slow writer never started"
        time.sleep(0.02)


def target_directory_removed_during_write(ctx, persistent):
    def remove_dir(ctx, path):
        dist.barrier()  # every rank has scheduled
        if ctx.rank == 0:
            _wait_for_started_write(path)
            # One atomic step: a recursive delete races with writers still creating files
            # in it (ENOTEMPTY), which would leave this rank out of step with the others.
            os.rename(path, path + ".removed")
            shutil.rmtree(path + ".removed", ignore_errors=True)
        dist.barrier()

    summary = _fault_round(
        ctx, f"rmdir-{persistent}", _queue(persistent), _Strategy(_SlowWriter), after_schedule=remove_dir
    )
    assert summary["failures"], summary
    return summary


def worker_killed_mid_write(ctx, persistent):
    def kill_writer(ctx, path):
        if ctx.rank == FAULTY_RANK:
            _wait_for_started_write(path)
            for child in psutil.Process().children(recursive=True):
                child.send_signal(signal.SIGKILL)

    queue = wait_until_worker_ready(_queue(persistent))
    summary = _fault_round(
        ctx, f"kill-{persistent}", queue, _Strategy(_SlowWriter), after_schedule=kill_writer
    )
    return _expect_phase(summary, FAULTY_RANK, "worker", "killed by signal 9")


HANG_TIMEOUT_S = 12.0
"""``timeout_s`` of the hang scenario: the frozen write must hit it, the healthy save before
it must not. 5 s was once too short for that healthy save on a loaded 2-core CI machine."""


def worker_hangs(ctx, persistent):
    # The writers inherit this rank's stderr: a file here, to read the stacks they write.
    log_path = os.path.join(ctx.tmp_dir, f"hang-{persistent}-rank{ctx.rank}.stderr")
    saved_stderr = os.dup(2)
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), 2)
    try:
        queue = _queue(persistent, timeout_s=HANG_TIMEOUT_S)
        summary = _fault_round(ctx, f"hang-{persistent}", queue, _Strategy(_FrozenWriter))
    finally:
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
    _expect_phase(summary, FAULTY_RANK, "timeout", f"timeout_s={HANG_TIMEOUT_S:.0f}")
    with open(log_path) as log:
        written = log.read()
    if ctx.rank == FAULTY_RANK:  # the writer's stacks name the frozen write
        assert re.search(r'scenarios_faults.py", line \d+ in write_preloaded_data', written), written
    assert summary["seconds"] < 60, summary
    return summary


def permission_denied(ctx, persistent):
    """The faulty rank loses root's permission override; the directory is then read-only.

    Read-only before the save: the strategy's up-front check refuses it on every rank.
    Made read-only while the background write waits to start: the write fails.
    """
    if ctx.rank == FAULTY_RANK and os.geteuid() == 0:
        _drop_permission_override()
    queue = AsyncCallsQueue(persistent=persistent)  # its worker starts without the override
    _QUEUES[("without-override", persistent)] = queue

    def make_read_only(ctx, path):
        dist.barrier()
        if ctx.rank == 0:
            os.chmod(path, 0o555)
        dist.barrier()

    def wait_then_make_read_only(ctx, path):
        if ctx.rank == 0:
            _wait_for_started_write(path)
        make_read_only(ctx, path)

    try:
        before = _fault_round(
            ctx, f"perm-before-{persistent}", queue, TorchDistAsyncSaveStrategy(),
            expected_error=CheckpointValidationError, before_schedule=make_read_only,
        )
        assert "is not writable" in before["message"] and f"rank {FAULTY_RANK}" in before["message"], before
        during = _fault_round(
            ctx, f"perm-during-{persistent}", queue, _Strategy(_SlowWriter),
            after_schedule=wait_then_make_read_only,
        )
        _expect_phase(during, FAULTY_RANK, "write", "Permission denied")
    finally:
        queue.close(abort=True)
        del _QUEUES[("without-override", persistent)]
    return {"before_save": before, "during_write": during}


def damaged_files_are_detected(ctx):
    """A truncated and a bit-flipped file: verify and the load-time check both catch them."""
    save_dir = _dir(ctx, "damage")
    manager = CheckpointManager(CheckpointManagerConfig(save_dir=save_dir, load_dir=save_dir))
    found = {}
    for iteration, damage in ((1, "flip"), (2, "truncate")):
        path = _managed_save(ctx, manager, _queue(False), TorchDistAsyncSaveStrategy(), iteration, _model_state(ctx, 3.0))
        verify_checkpoint_integrity(path)  # intact: no error
        victim = os.path.join(path, f"__{FAULTY_RANK}_0.distcp")
        if ctx.rank == 0:
            assert cli.main(["verify", path]) == 0
            size = os.path.getsize(victim)
            with open(victim, "r+b") as f:
                if damage == "flip":
                    f.seek(size // 2)
                    byte = f.read(1)
                    f.seek(size // 2)
                    f.write(bytes([byte[0] ^ 0x10]))
                else:
                    f.truncate(size - 7)
            assert cli.main(["verify", path]) == 1
        dist.barrier()
        try:
            verify_checkpoint_integrity(path)
        except CheckpointIntegrityError as exc:
            assert os.path.basename(victim) in str(exc), str(exc)
            found[damage] = str(exc).splitlines()[1][:160]
        else:
            raise AssertionError(f"{damage}: the load-time check passed a damaged checkpoint")
    # A load directory that only rank 0 sees (a node-local path, a mount missing on one
    # node): every rank raises the same error instead of rank 0 waiting for the others.
    seen_here = path if ctx.rank == 0 else path + "-missing-on-this-node"
    try:
        verify_checkpoint_integrity(seen_here)
    except CheckpointIntegrityError as exc:
        assert "not a directory here" in str(exc), str(exc)
        found["missing on one rank"] = str(exc).splitlines()[1][:160]
    else:
        raise AssertionError("the load-time check passed a directory one rank cannot see")
    return found


def two_saves_in_flight_to_different_directories(ctx, persistent):
    save_dir = _dir(ctx, f"twoinflight-{persistent}")
    manager = CheckpointManager(CheckpointManagerConfig(save_dir=save_dir, load_dir=save_dir))
    queue = _queue(persistent)
    strategy = _Strategy(_SlowWriter)
    for iteration in (1, 2):
        path = manager.prepare_save(iteration)
        request = dist_checkpointing.save(_model_state(ctx, float(iteration)), path, sharded_strategy=strategy, async_sharded_save=True)
        manager.attach_commit(request, iteration)
        queue.schedule_async_request(request)
    assert queue.get_num_unfinalized_calls() == 2
    queue.maybe_finalize_async_calls(blocking=True)
    assert read_tracker(save_dir) == 2
    for iteration in (1, 2):
        _check_checkpoint(ctx, manager.checkpoint_path(iteration), float(iteration))
    _assert_no_process_left_behind()


def second_save_into_a_directory_being_written(ctx):
    save_dir = _dir(ctx, "samedir")
    manager = CheckpointManager(CheckpointManagerConfig(save_dir=save_dir, load_dir=save_dir))
    queue = _queue(False)
    path = manager.prepare_save(5)
    request = dist_checkpointing.save(_model_state(ctx, 5.0), path, sharded_strategy=_Strategy(_SlowWriter), async_sharded_save=True)
    manager.attach_commit(request, 5)
    queue.schedule_async_request(request)
    refused = []
    try:
        manager.prepare_save(5)
    except CheckpointValidationError as exc:
        refused.append(("manager", str(exc)[:100]))
    try:
        dist_checkpointing.save(_model_state(ctx, 6.0), path, sharded_strategy=TorchDistAsyncSaveStrategy(), async_sharded_save=True)
    except CheckpointInProgressError as exc:
        refused.append(("strategy", str(exc)[:100]))
    queue.maybe_finalize_async_calls(blocking=True)
    assert [who for who, _ in refused] == ["manager", "strategy"], refused
    _check_checkpoint(ctx, path, 5.0)  # the save in flight was not disturbed
    assert read_tracker(save_dir) == 5
    return refused


def _drop_permission_override() -> None:
    """Remove CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER from this process for good.

    Dropped from the bounding set too, so that processes this one spawns (the persistent
    worker) do not get them back; file mode bits then apply to root as to anyone.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    caps = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
    for cap in caps:
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP failed")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    mask = ~sum(1 << cap for cap in caps) & 0xFFFFFFFF
    data[0].effective &= mask
    data[0].permitted &= mask
    data[0].inheritable &= mask
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    # Capabilities belong to a thread: the helper threads of our bounded steps, started
    # before the drop, would keep the override. A new pool starts new ones from this thread.
    from megatron_async.core.helper_threads import HelperThreads

    HelperThreads._process = None


SCENARIOS = {
    **by_name(
        exception_while_planning,
        exception_while_finalizing,
        metadata_json_cannot_be_written,
        damaged_files_are_detected,
        second_save_into_a_directory_being_written,
    ),
    # Both callers: the faults that differ by caller (the background process that dies,
    # hangs or meets the full disk is a forked child or the persistent worker).
    **for_both_callers(disk_full, worker_killed_mid_write, worker_hangs),
    # One caller: staging runs in the trainer and a failed write is reported the same way
    # for both (disk_full and worker_killed_mid_write cover how each caller reports).
    **with_caller("temporal", exception_while_writing, target_directory_removed_during_write),
    **with_caller("persistent", exception_while_staging, two_saves_in_flight_to_different_directories),
    # Last: it takes a permission away from the faulty rank for the rest of the launch. The
    # persistent worker starts after that, so it must run without the override too.
    **with_caller("persistent", permission_denied),
}


def run_all(ctx: RankContext):
    outcomes = run_scenarios(ctx, only_selected(ctx, SCENARIOS))
    for queue in _QUEUES.values():
        queue.close(abort=True)
    return outcomes


# -- a launch of its own -------------------------------------------------------------------

STOPPED_RANK_TIMEOUT_S = 8.0
"""``coordination_timeout_s`` of the stopped-rank launch."""


def _stop_this_process() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def _resume_when_stopped(pid: int) -> None:
    """SIGCONT ``pid`` once it is stopped (a SIGCONT sent earlier would be lost)."""
    deadline = time.monotonic() + 30
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"rank process {pid} never stopped"
        time.sleep(0.05)
    os.kill(pid, signal.SIGCONT)


def rank_stopped_during_finalize(ctx: RankContext):
    """A rank stops (SIGSTOP) right before the commit's first collective: the others raise
    within ``coordination_timeout_s``, nothing marks the save complete, the previous
    checkpoint still loads.

    A launch of its own (entry point): the coordination group gets its timeout when the
    process's first queue creates it, and a group that timed out fails every later
    collective at once (the job has to restart). The survivor wakes the stopped rank with
    SIGCONT, which then fails its own next collective, so that the launch ends.
    """
    queue = AsyncCallsQueue(config=AsyncCallerConfig(coordination_timeout_s=STOPPED_RANK_TIMEOUT_S))
    hung_commit = coordinator_commit_hangs(ctx, queue)
    pids = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid())
    good = _dir(ctx, "before-stop")
    _save_async(queue, ctx, good, TorchDistAsyncSaveStrategy(), 1.0)
    failed = _dir(ctx, "stopped")
    request = dist_checkpointing.save(
        _model_state(ctx, 2.0), failed, sharded_strategy=TorchDistAsyncSaveStrategy(), async_sharded_save=True
    )
    if ctx.rank == FAULTY_RANK:  # after the agreement that the write is done everywhere
        request.finalize_fns.insert(0, _stop_this_process)
    queue.schedule_async_request(request)
    caught, started = None, time.monotonic()
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except (CoordinationError, AsyncSaveFailedError) as exc:
        caught = exc
    elapsed = time.monotonic() - started
    if ctx.rank != FAULTY_RANK:
        _resume_when_stopped(pids[FAULTY_RANK])
    assert caught is not None, f"no CoordinationError or AsyncSaveFailedError on rank {ctx.rank}"
    if ctx.rank != FAULTY_RANK:
        assert elapsed < STOPPED_RANK_TIMEOUT_S + 20, elapsed
    dist.barrier()
    leftovers = set(os.listdir(failed)) & set(_MARKERS)
    assert not leftovers, f"a save that never finalized is marked complete: {leftovers}"
    assert failed not in SaveDirectories.of_process().directories()
    _check_checkpoint(ctx, good, 1.0)
    queue.close(abort=True)
    _assert_no_process_left_behind()
    _expect_error_everywhere(
        CoordinationError, lambda: coordination.all_reduce_max([0]), "failed"
    )  # at once
    return {
        "error": type(caught).__name__, "seconds": round(elapsed, 2), "message": str(caught)[:300],
        "hung_commit": hung_commit,
    }


def coordinator_commit_hangs(ctx: RankContext, queue: AsyncCallsQueue):
    """Rank 0's ``.metadata`` write never returns (a hung mount): every rank raises the same
    error once the coordinator's step bound (half of ``coordination_timeout_s``) expires,
    the group stays usable, and the previous checkpoint still loads. When the mount
    recovers, the step left behind completes a consistent checkpoint that the tracker
    does not name. Runs first in the stopped-rank launch, which has a short timeout."""
    summary = _fault_round(ctx, "hung-commit", queue, _Strategy(_HangingFinishWriter))
    _expect_phase(summary, 0, "finalize", "writing .metadata of")
    assert summary["lines"][0].startswith("rank 0 [finalize] " + FileSystemStepTimeoutError.__module__), summary
    assert summary["error"] == "AsyncSaveFailedError", summary
    assert summary["seconds"] < STOPPED_RANK_TIMEOUT_S, summary  # rank 0 reported in time
    # The step left behind stops the process's saves: a retry into that directory is
    # refused on every rank at once (rank 0 alone knows the step; on 0.16-0.18 it leaves
    # common.pt untouched and our strategy's agreed check refuses), saying to restart the
    # job, and the group stays usable.
    stuck_dir = os.path.join(ctx.tmp_dir, "hung-commit", "iter_0000002")
    common = os.path.join(stuck_dir, "common.pt")
    def common_bytes():
        if not os.path.exists(common):
            return None
        with open(common, "rb") as file:
            return os.fstat(file.fileno()).st_ino, file.read()

    common_before = common_bytes()
    started = time.monotonic()
    _expect_error_everywhere(
        CheckpointInProgressError,
        lambda: dist_checkpointing.save(_model_state(ctx, 3.0), stuck_dir,
                                        sharded_strategy=TorchDistAsyncSaveStrategy(), async_sharded_save=True),
        "restart the job",
    )
    assert time.monotonic() - started < STOPPED_RANK_TIMEOUT_S / 2
    assert common_bytes() == common_before
    dist.barrier()
    _MOUNT_RECOVERED.set()
    late = os.path.join(stuck_dir, ".metadata")
    deadline = time.monotonic() + 60
    while ctx.rank == 0 and not os.path.exists(late):
        assert time.monotonic() < deadline, "the commit left behind never completed"
        time.sleep(0.05)
    dist.barrier()
    assert read_tracker(os.path.join(ctx.tmp_dir, "hung-commit")) == 1
    SaveDirectories.of_process()._stuck = None  # as a restarted job: the next scenarios save
    return summary
