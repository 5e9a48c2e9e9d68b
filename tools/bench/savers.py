"""The save methods compared, each behind one small interface (runs on every rank).

Every :class:`Saver` performs one complete save per :meth:`Saver.save` call the way a
training loop would: build the state dict, save (the part that blocks training), run a
training step while the write goes on in the background, then wait for the save to be
complete. It returns the moments in between, taken with ``time.monotonic`` (one clock
for every process of the machine, so background stamps compare with the trainer's).

Stall boundaries, per method:

* ours and megatron-core's: from the ``dist_checkpointing.save(..., async_sharded_save=True)``
  call until ``schedule_async_request`` returns (planning + staging + scheduling);
* DCP ``save``: the whole save;
* DCP ``async_save``: until it returns and, with asynchronous staging, until staging is
  complete (the training step changes the tensors in place, so it must wait for that).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._bg_timing import read_stamps, timed_call
from .config import OUR_VARIANTS, PRIORITY_VARIANTS
from .workloads import Workload

__all__ = [
    "Unsupported",
    "Saver",
    "OurSaver",
    "McoreSaver",
    "build_saver",
    "checksum_option",
    "checksum_variant",
]

_CHECKSUM_VARIANTS = {"ours_persistent_checksums": True, "ours_persistent_no_checksums": False}
"""Our persistent caller with the checksum option forced on or off (the opposite of its
default, so that the default run and this one give the with/without comparison)."""


class Unsupported(RuntimeError):
    """This save method cannot run here; the message says why."""


def _now() -> float:
    return time.monotonic()


def checksum_option() -> Optional[Tuple[str, bool]]:
    """``(name, default)`` of the boolean checksum option of our save config, or None."""
    from megatron_async.mcore.strategy import TorchDistSaveConfig

    for field in dataclasses.fields(TorchDistSaveConfig):
        if "checksum" in field.name and field.type in (bool, "bool"):
            return field.name, bool(field.default)
    return None


def checksum_variant() -> Optional[str]:
    """The variant that runs our persistent caller with checksums opposite to the default."""
    option = checksum_option()
    if option is None:
        return None
    return "ours_persistent_no_checksums" if option[1] else "ours_persistent_checksums"


class Saver(abc.ABC):
    """One save method on one rank.

    Attributes:
        notes: what a reader of the results should know about this method here
            (options that do not apply on this host, for example).
    """

    def __init__(self, name: str, train_step: bool, stamp_dir: str):
        self.name = name
        self.notes: List[str] = []
        self._train_step = train_step
        self._stamp_dir = stamp_dir

    def setup(self) -> None:
        """Create what lives across saves (queues, workers, stagers); may raise Unsupported."""

    @abc.abstractmethod
    def save(self, workload: Workload, checkpoint_dir: str, index: int) -> Dict[str, Any]:
        """Save once and wait until the checkpoint is complete; return the timings."""

    def close(self) -> None:
        """Release what :meth:`setup` created."""

    def _stamp_path(self, index: int) -> str:
        from torch.distributed import get_rank

        return os.path.join(self._stamp_dir, f"{self.name}_rank{get_rank()}_save{index}.json")

    def _maybe_train(self, workload: Workload) -> float:
        start = _now()
        if self._train_step:
            workload.train_step()
        return _now() - start


class _MegatronCoreStyleSaver(Saver):
    """Shared flow of the two methods driven by ``dist_checkpointing.save`` and a queue."""

    constant_structure = False

    def _make_queue(self):
        raise NotImplementedError

    def _make_strategy(self):
        raise NotImplementedError

    def setup(self) -> None:
        self.strategy = self._make_strategy()
        self.queue = self._make_queue()
        self._strategy_plan_s: Optional[float] = None

    def _profiled(self, index: int):
        return None

    def save(self, workload: Workload, checkpoint_dir: str, index: int) -> Dict[str, Any]:
        from megatron.core import dist_checkpointing

        t_begin = _now()
        state_dict = workload.sharded_state_dict(index)
        t0 = _now()
        profiler = self._profiled(index)
        # Megatron-LM skips the sharding validation (a gather of every rank's sharding)
        # once the structure is known to be constant; so do we after the first save.
        validate = not (self.constant_structure and index > 0)
        request = dist_checkpointing.save(
            state_dict,
            checkpoint_dir,
            sharded_strategy=self.strategy,
            async_sharded_save=True,
            validate_access_integrity=validate,
        )
        t1 = _now()
        stamp_path = self._stamp_path(index)
        finalize_marks: Dict[str, float] = {}

        def mark(name: str) -> None:
            finalize_marks[name] = _now()

        request = request._replace(
            async_fn=(
                functools.partial(timed_call, stamp_path, request.async_fn)
                if request.async_fn is not None
                else None
            ),
            finalize_fns=[functools.partial(mark, "start")]
            + list(request.finalize_fns)
            + [functools.partial(mark, "end")],
        )
        self.queue.schedule_async_request(request)
        t2 = _now()
        if profiler is not None:
            profiler.stop()
        train_s = self._maybe_train(workload)
        self.queue.maybe_finalize_async_calls(blocking=True)
        t4 = _now()
        stamps = read_stamps(stamp_path) or {}
        return {
            "build_s": t0 - t_begin,
            "plan_s": t1 - t0,
            "strategy_plan_s": self._strategy_plan_s,
            "stage_s": t2 - t1,
            "stall_s": t2 - t0,
            "train_step_s": train_s,
            "finalize_s": finalize_marks.get("end", t4) - finalize_marks.get("start", t4),
            "e2e_s": t4 - t0,
            "t_start": t0,
            "t_stall_end": t2,
            "write_start": stamps.get("start"),
            "write_end": stamps.get("end"),
            "reused_plans": bool(getattr(self.strategy, "last_save_reused_plans", False)),
        }

    def close(self) -> None:
        queue = getattr(self, "queue", None)
        if queue is not None:
            queue.close()


class OurSaver(_MegatronCoreStyleSaver):
    """Our strategy (megatron-core's default for ``'megatron_async'``) on our queue.

    Configured as a Megatron-LM user gets it from flags: ``--ckpt-assume-constant-structure``
    sets ``use_cached_ckpt_structure`` on the strategy (warm saves reuse plans and
    metadata, and skip megatron-core's sharding validation); the staging buffers are
    reused by default; ``thread_count`` is the run's files per rank. With
    ``trainer_priority`` the writer runs at the trainer's CPU and I/O priority instead of
    the default lower one.
    """

    constant_structure = True

    def __init__(self, name: str, train_step: bool, stamp_dir: str, *, persistent: bool,
                 thread_count: int, checksums: Optional[bool] = None,
                 profile_dir: Optional[str] = None, trainer_priority: bool = False):
        super().__init__(name, train_step, stamp_dir)
        self._persistent = persistent
        self._trainer_priority = trainer_priority
        self._thread_count = thread_count
        self._checksums = checksums
        self._profile_dir = profile_dir

    def _make_strategy(self):
        import megatron_async  # noqa: F401  (registers the strategy)
        from megatron.core.dist_checkpointing.strategies.base import (
            StrategyAction,
            get_default_strategy,
        )

        registered = get_default_strategy(StrategyAction.SAVE_SHARDED, "megatron_async", 1)
        options = dict(thread_count=self._thread_count)
        if self._checksums is not None:
            option = checksum_option()
            if option is None:
                raise Unsupported("our save config has no checksum option yet")
            options[option[0]] = self._checksums
        saver = self

        class _TimedStrategy(type(registered)):
            """The registered strategy class, timing its own planning (``async_save``)."""

            def async_save(self, sharded_state_dict, checkpoint_dir):
                start = _now()
                try:
                    return super().async_save(sharded_state_dict, checkpoint_dir)
                finally:
                    saver._strategy_plan_s = _now() - start

        strategy = _TimedStrategy(config=dataclasses.replace(registered.config, **options))
        strategy.use_cached_ckpt_structure = True  # what --ckpt-assume-constant-structure does
        return strategy

    def _make_queue(self):
        from megatron_async.core import AsyncCallerConfig, AsyncCallsQueue, WriterPriority

        # A short poll interval so that the measured wait is not mostly polling pauses.
        config = AsyncCallerConfig(poll_interval_s=0.005)
        if self._trainer_priority:
            trainer_priority = WriterPriority(nice_increment=0, io_class="inherit")
            config = dataclasses.replace(config, writer_priority=trainer_priority)
        return AsyncCallsQueue(persistent=self._persistent, config=config)

    def _profiled(self, index: int):
        """Start profiling this save's stall (rank 0, with ``--profile``)."""
        from torch.distributed import get_rank

        self._profiler = None
        if self._profile_dir is None or get_rank() != 0:
            return None
        from pyinstrument import Profiler

        self._profiler = Profiler(interval=0.0005)
        self._profiler.start()
        return self._profiler

    def save(self, workload: Workload, checkpoint_dir: str, index: int) -> Dict[str, Any]:
        record = super().save(workload, checkpoint_dir, index)
        if self._profiler is not None:
            os.makedirs(self._profile_dir, exist_ok=True)
            path = os.path.join(
                self._profile_dir,
                f"{self.name}_{workload.name}_{workload.tensor_count}t_save{index}.txt",
            )
            with open(path, "w") as f:
                f.write(self._profiler.output_text(unicode=False, color=False))
        return record


class McoreSaver(_MegatronCoreStyleSaver):
    """megatron-core's ``torch_dist`` async strategy on megatron-core's ``AsyncCallsQueue``."""

    def __init__(self, name: str, train_step: bool, stamp_dir: str, *, persistent: bool):
        super().__init__(name, train_step, stamp_dir)
        self._persistent = persistent

    def _make_strategy(self):
        from megatron.core.dist_checkpointing.strategies.base import (
            StrategyAction,
            get_default_strategy,
        )

        return get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)

    def _make_queue(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        return AsyncCallsQueue(persistent=self._persistent)

    def setup(self) -> None:
        if not torch.cuda.is_available() and self._persistent:
            # Not attempted: its worker dies at start-up and the trainer then waits for it
            # without a bound (observed with megatron-core 0.16 on CPU-only torch).
            raise Unsupported(
                "megatron-core's PersistentAsyncCaller needs CUDA: its worker loop ("
                f"{_cuda_call_site('PersistentAsyncCaller.async_loop')}) sets a CUDA device at "
                "start-up, which fails on CPU-only torch (ZeroDivisionError: device_count() is 0), "
                "and the trainer then waits for the dead worker without a bound, so it is not run "
                "here"
            )
        super().setup()

    def save(self, workload: Workload, checkpoint_dir: str, index: int) -> Dict[str, Any]:
        try:
            return super().save(workload, checkpoint_dir, index)
        except Exception as exc:
            if torch.cuda.is_available():
                raise
            raise Unsupported(
                f"megatron-core's async save needs CUDA, and this torch has none: "
                f"{type(exc).__name__}: {exc} (raised at {_innermost_megatron_frame(exc)})"
            ) from exc

    def close(self) -> None:
        try:
            super().close()
        except Exception as exc:  # its queue itself calls CUDA; nothing left to release
            self.notes.append(f"closing megatron-core's queue failed: {type(exc).__name__}: {exc}")


def _cuda_call_site(qualified_name: str) -> str:
    """``file:line: code`` of the first CUDA call in a megatron-core ``async_utils`` function
    (``"Class.method"`` or ``"function"``), found in its source."""
    import inspect

    from megatron.core.dist_checkpointing.strategies import async_utils

    function = async_utils
    for part in qualified_name.split("."):
        function = getattr(function, part, None)
    if function is None:
        return f"async_utils.{qualified_name}"
    lines, first = inspect.getsourcelines(inspect.unwrap(function))
    for offset, line in enumerate(lines):
        if "torch.cuda." in line:
            return f"async_utils.py:{first + offset} in {qualified_name}: {line.strip()}"
    return f"async_utils.{qualified_name}"


def _innermost_megatron_frame(exc: BaseException) -> str:
    """``file:line in function: code`` of the deepest megatron-core frame of ``exc``."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "megatron" in f.filename]
    if not frames:
        return "unknown location"
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}: {frame.line}"


def build_saver(name: str, payload: Dict[str, Any], stamp_dir: str) -> Saver:
    """Create the saver a variant name stands for (see ``config.ALL_VARIANTS``)."""
    train_step = payload["train_step"]
    threads = payload["thread_count"]
    if name in OUR_VARIANTS or name in PRIORITY_VARIANTS or name in _CHECKSUM_VARIANTS:
        return OurSaver(
            name, train_step, stamp_dir, persistent=not name.startswith("ours_temporal"),
            thread_count=threads, checksums=_CHECKSUM_VARIANTS.get(name),
            profile_dir=payload.get("profile_dir"), trainer_priority=name in PRIORITY_VARIANTS,
        )
    if name.startswith("mcore_async_"):
        return McoreSaver(name, train_step, stamp_dir, persistent=name.endswith("persistent"))
    from .dcp_saver import DcpSaver

    if name == "dcp_save":
        return DcpSaver(name, train_step, stamp_dir, mode="sync", reuse_stager=False,
                        thread_count=threads)
    if name.startswith("dcp_async_"):
        mode = "process" if "process" in name else "thread"
        return DcpSaver(name, train_step, stamp_dir, mode=mode,
                        reuse_stager=name.endswith("_staged"), thread_count=threads)
    raise ValueError(f"unknown save method {name!r}")
