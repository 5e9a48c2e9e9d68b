"""Save methods driven by megatron-core's ``dist_checkpointing.save`` and a queue (every rank).

Ours (our strategy on our queue) and megatron-core's own (its ``torch_dist`` async strategy
on its ``AsyncCallsQueue``). The stall runs from the ``dist_checkpointing.save(...,
async_sharded_save=True)`` call until ``schedule_async_request`` returns (planning +
staging + scheduling); the background write stamps its own start and end
(:func:`._bg_timing.timed_call`, run where the write runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Dict, Optional, Tuple

import torch

from ._bg_timing import read_stamps, timed_call
from .base import SaveMethod, StateSource, Unsupported, now

__all__ = ["QueueSave", "OurQueueSave", "McoreQueueSave", "checksum_option", "checksum_variant"]


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


class QueueSave(SaveMethod):
    """Shared flow of the methods driven by ``dist_checkpointing.save`` and a queue.

    Args:
        source: the state saved.
        stamp_dir: where the background write leaves its start and end stamps.
    """

    constant_structure = False
    """Skip megatron-core's sharding validation after the first save (as Megatron-LM does
    once the structure is known to be constant)."""

    def __init__(self, name: str, source: StateSource, stamp_dir: str):
        super().__init__(name)
        self._source = source
        self._stamp_dir = stamp_dir
        self._strategy_plan_s: Optional[float] = None
        self.save_options: Dict[str, Any] = {}
        """Further keyword arguments of ``dist_checkpointing.save`` this method needs."""

    def _make_queue(self):
        raise NotImplementedError

    def _make_strategy(self):
        raise NotImplementedError

    def _start_profile(self, index: int) -> None:
        """Start profiling the stall (a hook; no profiling by default)."""

    def _stop_profile(self) -> None:
        """Stop what :meth:`_start_profile` started, once the stall is over."""

    def _report_profile(self, index: int) -> None:
        """Write what the profiler saw, once the save is complete."""

    def setup(self) -> None:
        self.strategy = self._make_strategy()
        self.queue = self._make_queue()

    def save(self, directory: str, index: int) -> None:
        from megatron.core import dist_checkpointing
        from torch.distributed import get_rank

        t_begin = self._begin()
        state_dict = self._source.sharded_state_dict(index)
        t0 = now()
        self._start_profile(index)
        validate = not (self.constant_structure and index > 0)
        request = dist_checkpointing.save(
            state_dict,
            directory,
            sharded_strategy=self.strategy,
            async_sharded_save=True,
            validate_access_integrity=validate,
            **self.save_options,
        )
        t1 = now()
        self._index = index
        self._stamp_path = os.path.join(self._stamp_dir,
                                        f"{self.name}_rank{get_rank()}_save{index}.json")
        self._finalize_marks: Dict[str, float] = {}

        def mark(name: str) -> None:
            self._finalize_marks[name] = now()

        request = request._replace(
            async_fn=(
                functools.partial(timed_call, self._stamp_path, request.async_fn)
                if request.async_fn is not None
                else None
            ),
            finalize_fns=[functools.partial(mark, "start")]
            + list(request.finalize_fns)
            + [functools.partial(mark, "end")],
        )
        self.queue.schedule_async_request(request)
        t2 = now()
        self._stop_profile()
        self.timings.update(build_s=t0 - t_begin, t_start=t0, t_stall_end=t2, plan_s=t1 - t0,
                            stage_s=t2 - t1, strategy_plan_s=self._strategy_plan_s)

    def poll(self) -> bool:
        self.queue.maybe_finalize_async_calls(blocking=False)
        done = self.queue.get_num_unfinalized_calls() == 0
        if done:
            self._complete()
        return done

    def wait(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)
        self._complete()

    def _complete(self) -> None:
        if "t_end" in self.timings:  # already seen complete
            return
        t4 = now()
        stamps = read_stamps(self._stamp_path) or {}
        marks = self._finalize_marks
        self.timings.update(
            t_end=t4, finalize_s=marks.get("end", t4) - marks.get("start", t4),
            write_start=stamps.get("start"), write_end=stamps.get("end"),
            reused_plans=self._reused_plans())
        self._report_profile(self._index)

    def _reused_plans(self) -> bool:
        """Whether the latest save reused cached plans (megatron-core's strategy keeps no record)."""
        return False

    def close(self) -> None:
        queue = getattr(self, "queue", None)
        if queue is not None:
            queue.close()


class OurQueueSave(QueueSave):
    """Our strategy (megatron-core's default for ``'megatron_async'``) on our queue.

    Configured as a Megatron-LM user gets it from flags: ``--ckpt-assume-constant-structure``
    sets ``use_cached_ckpt_structure`` on the strategy (warm saves reuse plans and
    metadata, and skip megatron-core's sharding validation); the staging buffers are
    reused by default; ``thread_count`` is the run's files per rank. With
    ``trainer_priority`` the writer runs at the trainer's CPU priority instead of
    the default lower one. With ``profile_path`` (a ``{index}`` template), rank 0 writes a
    pyinstrument report of each save's stall there.
    """

    constant_structure = True

    def __init__(self, name: str, source: StateSource, stamp_dir: str, *, persistent: bool,
                 thread_count: int, checksums: Optional[bool] = None,
                 profile_path: Optional[str] = None, trainer_priority: bool = False):
        super().__init__(name, source, stamp_dir)
        self._persistent = persistent
        self._trainer_priority = trainer_priority
        self._thread_count = thread_count
        self._checksums = checksums
        self._profile_path = profile_path
        self._profiler = None

    def _make_strategy(self):
        from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy

        options = dict(thread_count=self._thread_count)
        if self._checksums is not None:
            option = checksum_option()
            if option is None:
                raise Unsupported("our save config has no checksum option yet")
            options[option[0]] = self._checksums
        method = self

        class _TimedStrategy(TorchDistAsyncSaveStrategy):
            """Our strategy, timing its own planning (``async_save``)."""

            def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy=None):
                start = now()
                try:
                    return super().async_save(sharded_state_dict, checkpoint_dir)
                finally:
                    method._strategy_plan_s = now() - start

        strategy = _TimedStrategy("torch_dist", 1, **options)
        strategy.use_cached_ckpt_structure = True  # what --ckpt-assume-constant-structure does
        return strategy

    def _reused_plans(self) -> bool:
        return self.strategy.plan_cache.last_save_reused_plans

    def _make_queue(self):
        from megatron_async.core import AsyncCallerConfig, AsyncCallsQueue

        # A short poll interval so that the measured wait is not mostly polling pauses.
        config = AsyncCallerConfig(poll_interval_s=0.005)
        if self._trainer_priority:
            config = dataclasses.replace(config, writer_nice_increment=0)
        return AsyncCallsQueue(persistent=self._persistent, config=config)

    def _start_profile(self, index: int) -> None:
        """Start profiling this save's stall (rank 0, with ``--profile``)."""
        from torch.distributed import get_rank

        self._profiler = None
        if self._profile_path is None or get_rank() != 0:
            return
        from pyinstrument import Profiler

        self._profiler = Profiler(interval=0.0005)
        self._profiler.start()

    def _stop_profile(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()

    def _report_profile(self, index: int) -> None:
        if self._profiler is None:
            return
        path = self._profile_path.format(index=index)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(self._profiler.output_text(unicode=False, color=False))


class McoreQueueSave(QueueSave):
    """megatron-core's ``torch_dist`` async strategy on megatron-core's ``AsyncCallsQueue``."""

    def __init__(self, name: str, source: StateSource, stamp_dir: str, *, persistent: bool):
        super().__init__(name, source, stamp_dir)
        self._persistent = persistent

    def _make_strategy(self):
        from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

        if hasattr(mcore_torch, "TorchDistSaveShardedStrategy"):  # 0.17+: no registry
            # save() runs megatron-core's own async path only when asked ("nvrx" is its
            # default from 0.17 and needs nvidia-resiliency-ext).
            self.save_options = {"async_strategy": "mcore"}
            return mcore_torch.TorchDistSaveShardedStrategy("torch_dist", 1)
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

    def save(self, directory: str, index: int) -> None:
        with _cuda_required():
            super().save(directory, index)

    def wait(self) -> None:
        with _cuda_required():
            super().wait()

    def close(self) -> None:
        try:
            super().close()
        except Exception as exc:  # its queue itself calls CUDA; nothing left to release
            self.notes.append(f"closing megatron-core's queue failed: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _cuda_required():
    """Turn a failure of megatron-core's async save on CPU-only torch into Unsupported."""
    try:
        yield
    except Exception as exc:
        if torch.cuda.is_available():
            raise
        raise Unsupported(
            f"megatron-core's async save needs CUDA, and this torch has none: "
            f"{type(exc).__name__}: {exc} (raised at {_innermost_megatron_frame(exc)})"
        ) from exc


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
