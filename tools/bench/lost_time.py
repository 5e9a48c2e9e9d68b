"""Training time lost per checkpoint, measured inside a real training loop (a rank job).

Every rank trains the GPT example's model with its distributed optimizer, built with
the example's own functions (``build_model``, ``build_optimizer``, ``train_step``), and
checkpoints it with one method. Iterations are timed the way the example's loop runs
them: each one first polls for finished saves (non-blocking), then trains a step.

Order (the warm-up is three iterations once the model is built):

1. set the method up, timed: for ours, the example's queue (and with the persistent
   caller the worker start) before the model is built, as the example and Megatron-LM
   create it, then the example's ``Checkpointer``; the model's build time is recorded;
2. per save: a *free window* of ``window`` iterations without any save in flight, then
   the save call (its *stall*) and iterations until the checkpoint is durable on every
   rank (the *save window*; the ranks agree each iteration, as the example's finalize
   does).

The first free window follows the set-up, so it carries what the set-up still costs
afterwards; the others give the checkpoint-free iteration time, interleaved with the
saves so that drift cancels. Since our queue is created before the model, a persistent
worker's start-up (a fresh interpreter importing torch, with ``ours_persistent_exec``)
runs during the model's build and warm-up, and during the memory-copy measurement: it
shows in ``build_s`` and the warm-up times, which the report puts beside every row. Per-iteration times
are the maximum over ranks (a step is as slow as its slowest rank).

Methods (:data:`METHODS`):

* ``sync``: the example without ``--async-save`` (our strategy, synchronous);
* ``ours_temporal`` / ``ours_persistent``: ``--async-save`` (``--use-persistent-ckpt-worker``)
  ``--ckpt-assume-constant-structure`` (the worker forked from the trainer);
  ``ours_persistent_exec`` starts the worker as a fresh interpreter instead
  (``--ckpt-worker-start exec``); ``ours_persistent_overlap`` adds
  ``--ckpt-overlap-staging``;
* ``dcp_thread`` / ``dcp_process``: ``dcp.async_save`` with its thread or process
  executor and one reused ``DefaultStager`` (synchronous staging; shared memory for the
  process executor);
* ``dcp_async_staging``: ``dcp.async_save`` (thread executor) with
  ``DefaultStager(StagingOptions(use_async_staging=True))``; the next optimizer step
  waits for its staging future (a torch optimizer step pre-hook), as torchtitan does.
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .launch import RankContext

__all__ = ["METHODS", "OUR_METHODS", "DCP_METHODS", "EXAMPLE_FLAGS", "ExampleTrainer", "lost_time_job"]

OUR_METHODS = ("ours_temporal", "ours_persistent", "ours_persistent_exec", "ours_persistent_overlap")
DCP_METHODS = ("dcp_thread", "dcp_process", "dcp_async_staging")
METHODS = ("sync",) + OUR_METHODS + DCP_METHODS

EXAMPLE_FLAGS = {
    "sync": [],
    "ours_temporal": ["--async-save", "--ckpt-assume-constant-structure"],
    "ours_persistent": ["--async-save", "--use-persistent-ckpt-worker",
                        "--ckpt-assume-constant-structure"],
    "ours_persistent_exec": ["--async-save", "--use-persistent-ckpt-worker",
                             "--ckpt-assume-constant-structure", "--ckpt-worker-start", "exec"],
    "ours_persistent_overlap": ["--async-save", "--use-persistent-ckpt-worker",
                                "--ckpt-assume-constant-structure", "--ckpt-overlap-staging"],
}
_WARMUP_ITERATIONS = 3
_MAX_SAVE_WINDOW = 200
"""Iterations a save window may take before the benchmark waits for the save (blocking)."""

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _now() -> float:
    return time.monotonic()


class ExampleTrainer:
    """The example's model, distributed optimizer and data on this rank.

    Built in the example's order: flags and process groups here, then (after the
    checkpointing queue, see :meth:`_Method.start_early`) :meth:`build`.
    """

    def __init__(self, payload: Dict[str, Any], save_dir: str, flags: List[str]):
        examples = os.path.join(_REPO_ROOT, "examples")
        if examples not in sys.path:
            sys.path.insert(0, examples)
        from gpt import cpu_compat
        from gpt.arguments import parse_args, validate_parallel_args
        from megatron.core import parallel_state

        cpu_compat.install()
        self.args = parse_args([
            "--train-iters", "1000000", "--num-layers", str(payload["num_layers"]),
            "--hidden-size", str(payload["hidden_size"]), "--num-attention-heads", "8",
            "--use-distributed-optimizer", "--save", save_dir, "--save-interval", "1",
            *flags,
        ])
        validate_parallel_args(self.args, dist.get_world_size())
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)

    def build(self) -> None:
        """Build the model, its distributed optimizer and the data."""
        from gpt.data import build_dataset
        from gpt.model import build_model, build_optimizer, resolve_transformer_impl, set_seed

        self.args.transformer_impl = resolve_transformer_impl("auto")
        set_seed(self.args.seed)
        self.model = build_model(self.args)
        self.optimizer = build_optimizer(self.args, self.model)
        self.dataset = build_dataset(self.args)
        self.consumed = 0
        self.iteration = 0

    def step(self) -> None:
        from gpt.data import micro_batches
        from gpt.model import train_step
        from megatron.core import parallel_state

        args = self.args
        batches = micro_batches(self.dataset, self.consumed, args.global_batch_size,
                                args.micro_batch_size, parallel_state.get_data_parallel_rank(),
                                parallel_state.get_data_parallel_world_size())
        train_step(self.model, self.optimizer, batches, args.num_micro_batches, args)
        self.consumed += args.global_batch_size
        self.iteration += 1

    def main_replicas(self) -> Dict[str, torch.Tensor]:
        """This rank's saved tensors (main replicas), under keys unique to this rank."""
        from .workloads import GptWorkload

        model_sd = self.model.module.sharded_state_dict()
        state = {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
        rank = dist.get_rank()
        return {f"rank{rank}/{key}": tensor
                for key, tensor in GptWorkload._collect_main_replicas(state).items()}


class _Method:
    """One checkpointing method inside the loop (every rank)."""

    def start_early(self) -> None:
        """What the example creates before the model (its background-save queue)."""

    def setup(self) -> None:
        """Create what lives across saves."""

    def save(self, directory_index: int) -> None:
        """Start a save of the current state (what blocks the loop is the stall)."""

    def poll(self) -> bool:
        """Non-blocking, collective: whether the last save is durable on every rank."""
        return True

    def wait(self) -> None:
        """Block until the last save is durable (bounded by the launch's timeout)."""

    def close(self) -> None:
        """Release everything."""


class _ExampleCheckpointer(_Method):
    """The example's own ``Checkpointer`` (sync, or async with our callers)."""

    def __init__(self, trainer: ExampleTrainer):
        self._trainer = trainer
        self._pending = False
        self._queue = None
        self._checkpointer = None

    def start_early(self) -> None:
        from gpt.checkpointing import create_checkpoint_queue

        self._queue = create_checkpoint_queue(self._trainer.args)

    def setup(self) -> None:
        from gpt.checkpointing import Checkpointer

        self._checkpointer = Checkpointer(self._trainer.args, self._trainer.model,
                                          self._trainer.optimizer, self._queue)

    def save(self, directory_index: int) -> None:
        trainer = self._trainer
        record = self._checkpointer.save(trainer.iteration, trainer.consumed)
        self._pending = record.is_async

    def poll(self) -> bool:
        if self._pending and self._checkpointer.maybe_finalize(blocking=False):
            self._pending = False
        return not self._pending

    def wait(self) -> None:
        self._checkpointer.maybe_finalize(blocking=True)
        self._pending = False

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
        elif self._queue is not None:  # set-up never ran: the early queue is closed alone
            self._queue.close()


class _Dcp(_Method):
    """PyTorch DCP ``async_save`` with one reused ``DefaultStager``."""

    def __init__(self, trainer: ExampleTrainer, root: str, executor: str, async_staging: bool):
        self._trainer = trainer
        self._root = root
        self._executor = executor
        self._async_staging = async_staging
        self._upload = None
        self._staging = None
        self._hook = None
        self._stager = None

    def setup(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # A group of its own: the background save's collectives must not interleave with
        # the training loop's on the same group (that hangs).
        self._group = dist.new_group(backend="gloo")
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=self._executor == "process",
            use_async_staging=self._async_staging, use_non_blocking_copy=cuda))
        if self._async_staging:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            # torchtitan waits for the staging future before the next optimizer step.
            self._hook = register_optimizer_step_pre_hook(self._wait_for_staging)

    def _wait_for_staging(self, *_args) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.result()

    def save(self, directory_index: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
        )

        directory = os.path.join(self._root, f"iter_{directory_index:07d}")
        writer = dcp.FileSystemWriter(directory, thread_count=2)
        kind = (AsyncCheckpointerType.PROCESS if self._executor == "process"
                else AsyncCheckpointerType.THREAD)
        response = dcp.async_save(self._trainer.main_replicas(), storage_writer=writer,
                                  async_checkpointer_type=kind, async_stager=self._stager,
                                  process_group=self._group)
        if isinstance(response, AsyncSaveResponse):
            self._staging, self._upload = response.staging_completion, response.upload_completion
        else:
            self._upload = response

    def poll(self) -> bool:
        local = self._upload is None or self._upload.done()
        flag = torch.tensor([0 if local else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag[0]) == 0 and self._upload is not None:
            self._upload.result()  # raises a failed save
            self._upload = None
        return int(flag[0]) == 0

    def wait(self) -> None:
        if self._upload is not None:
            self._upload.result()
            self._upload = None
        dist.barrier()

    def close(self) -> None:
        if self._stager is None:  # set-up never ran
            return
        self.wait()
        if self._hook is not None:
            self._hook.remove()
        self._stager.close()


def _build_method(name: str, trainer: ExampleTrainer, root: str) -> _Method:
    if name in EXAMPLE_FLAGS:
        return _ExampleCheckpointer(trainer)
    if name == "dcp_async_staging":
        return _Dcp(trainer, root, "thread", async_staging=True)
    if name in ("dcp_thread", "dcp_process"):
        return _Dcp(trainer, root, name.split("_")[1], async_staging=False)
    raise ValueError(f"unknown lost-time method {name!r}; choose from {list(METHODS)}")


def _memcpy_seconds(num_bytes: int, group) -> float:
    """One memory copy of this rank's state, every rank at once (best of three)."""
    src = torch.randint(0, 255, (max(num_bytes, 1),), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        dist.barrier(group=group)
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def _timed_iteration(trainer: ExampleTrainer, method: Optional[_Method], polls: Optional[list] = None
                     ) -> tuple:
    """One loop iteration (poll, then train); returns ``(seconds, durable)``.

    With ``polls``, the poll's own time (where a finished save is finalized) is appended.
    """
    start = _now()
    durable = method.poll() if method is not None else True
    if polls is not None:
        polls.append(_now() - start)
    trainer.step()
    return _now() - start, durable


class _CpuMeter:
    """CPU seconds (user + system) used by this rank's process and by its background
    processes (every descendant: forked writers, the persistent worker), and by the whole
    machine (``/proc/stat``, all cores), between :meth:`start` and :meth:`stop`."""

    def __init__(self):
        import psutil

        self._me = psutil.Process()

    def _background_seconds(self) -> float:
        """CPU time of every live descendant and of every descendant already reaped.

        A reaped child's time (its own reaped children's included) is in this process's
        ``children_*`` counters; a live one's reaped children are in its own.
        """
        total = 0.0
        for child in self._me.children(recursive=True):
            try:
                t = child.cpu_times()
            except Exception:  # it ended between listing and reading
                continue
            total += t.user + t.system + t.children_user + t.children_system
        own = self._me.cpu_times()
        return total + own.children_user + own.children_system

    @staticmethod
    def _machine_seconds() -> Dict[str, float]:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        tick = os.sysconf("SC_CLK_TCK")
        names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
        return {n: int(v) / tick for n, v in zip(names, fields)}

    def start(self) -> None:
        times = self._me.cpu_times()
        self._own = times.user + times.system
        self._children = self._background_seconds()
        self._machine = self._machine_seconds()

    def stop(self) -> Dict[str, float]:
        times = self._me.cpu_times()
        machine = self._machine_seconds()
        result = {"rank_cpu_s": times.user + times.system - self._own,
                  "background_cpu_s": self._background_seconds() - self._children}
        result.update({f"machine_{n}_s": machine[n] - self._machine[n] for n in machine})
        return result


def lost_time_job(ctx: RankContext) -> Dict[str, Any]:
    """Train with saves of ``payload["method"]`` and time every iteration (every rank).

    Returns this rank's timings: ``setup_s``, ``warmup``, ``windows`` (one per save:
    ``free`` iteration times, ``stall_s``, ``save`` iteration times until durable,
    ``blocking_wait_s`` when the save outlived the window bound), the state's bytes
    and one memory copy's time.
    """
    payload = ctx.payload
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=900))
    root = os.path.join(payload["checkpoint_root"], payload["tag"])
    if ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier(group=group)
    name = payload["method"]
    trainer = ExampleTrainer(payload, root, EXAMPLE_FLAGS.get(name, []))
    method = _build_method(name, trainer, root)
    try:
        # As the example (and Megatron-LM) does: the queue, and with it the persistent
        # worker, before the model. Its time counts as set-up; the model's build time is
        # recorded so that any cost the early worker moves into the build stays visible.
        dist.barrier(group=group)
        start = _now()
        method.start_early()
        early_setup_s = _now() - start
        start = _now()
        trainer.build()
        build_s = _now() - start
        # Warm-up first: the optimizer state exists only after a step.
        warmup = [_timed_iteration(trainer, None)[0] for _ in range(_WARMUP_ITERATIONS)]
        num_bytes = sum(t.numel() * t.element_size() for t in trainer.main_replicas().values())
        result: Dict[str, Any] = {"rank": ctx.rank, "num_bytes": num_bytes, "warmup": warmup,
                                  "build_s": build_s, "early_setup_s": early_setup_s,
                                  "memcpy_s": _memcpy_seconds(num_bytes, group)}
        dist.barrier(group=group)
        start = _now()
        method.setup()
        result["setup_s"] = early_setup_s + _now() - start
        windows: List[Dict[str, Any]] = []
        meter = _CpuMeter()
        for index in range(payload["saves"]):
            window: Dict[str, Any] = {"free": [], "save": [], "save_polls": [],
                                      "blocking_wait_s": 0.0}
            meter.start()
            for _ in range(payload["window"]):
                window["free"].append(_timed_iteration(trainer, method)[0])
            window["free_cpu"] = meter.stop()
            meter.start()
            start = _now()
            method.save(index)
            window["stall_s"] = _now() - start
            durable = False
            while not durable and len(window["save"]) < _MAX_SAVE_WINDOW:
                seconds, durable = _timed_iteration(trainer, method, window["save_polls"])
                # The iteration that found the save durable finalized it inside its poll.
                window["save"].append(seconds)
            if not durable:
                start = _now()
                method.wait()
                window["blocking_wait_s"] = _now() - start
            window["save_cpu"] = meter.stop()
            windows.append(window)
    finally:
        method.close()
        dist.barrier(group=group)
        if ctx.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    result["windows"] = windows
    return result
