"""PyTorch DCP's ``save`` and ``async_save`` as a save method (every rank).

DCP's ``async_save`` plans and writes in its background thread or process, so its stall
is staging only: until ``async_save`` returns and, with asynchronous staging, until the
staging future resolves, either inside the stall (the training step changes the tensors
in place, so it must wait) or right before the next optimizer step (what torchtitan does).
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch
import torch.distributed as dist

from .base import SaveMethod, StateSource, now

__all__ = ["DcpOptions", "DcpSave", "default_stager_survives_reuse"]

_EXECUTORS = ("sync", "thread", "process")
_STAGING_WAITS = ("in_stall", "before_optimizer_step")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DcpOptions:
    """How DCP saves."""

    executor: str
    """``"sync"`` (``dcp.save``), or the ``async_save`` executor: ``"thread"`` or ``"process"``."""
    thread_count: int
    """``FileSystemWriter`` threads (files) per rank."""
    reuse_stager: bool = False
    """Pass one ``DefaultStager`` kept across saves (shared memory for the process executor;
    pinned memory and non-blocking copies where an accelerator is) instead of letting each
    call stage a fresh copy."""
    async_staging: bool = True
    """The reused stager stages in the background (``use_async_staging``)."""
    staging_wait: str = "in_stall"
    """Where the training thread waits for asynchronous staging: ``"in_stall"`` or
    ``"before_optimizer_step"`` (a torch optimizer step pre-hook)."""
    own_group: bool = False
    """Run the save's collectives on a gloo group of its own, for a training loop whose own
    collectives run while the save is in flight (on one group they would interleave and hang)."""

    def __post_init__(self):
        if self.executor not in _EXECUTORS:
            raise ValueError(f"DCP executor {self.executor!r} is not one of {_EXECUTORS}")
        if self.staging_wait not in _STAGING_WAITS:
            raise ValueError(f"staging_wait {self.staging_wait!r} is not one of {_STAGING_WAITS}")
        if self.executor == "sync" and self.reuse_stager:
            raise ValueError("dcp.save stages nothing: a reused stager needs an async executor")


def default_stager_survives_reuse() -> bool:
    """Whether one ``DefaultStager`` stages twice (torch 2.11's does not; 2.13's does).

    torch 2.11's ``StateDictStager.close()``, run after every stage, empties its table of
    copiers, and the second stage then fails on any dict (``KeyError: <class 'type'>``).
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
        return True
    except KeyError:
        return False
    finally:
        stager.close()


class DcpSave(SaveMethod):
    """PyTorch DCP: ``save``, or ``async_save`` with a thread or process executor."""

    def __init__(self, name: str, source: StateSource, options: DcpOptions):
        super().__init__(name)
        self._source = source
        self._options = options
        self._stager = None
        self._group = None
        self._hook = None
        self._staging = None
        self._upload = None
        self._stager_per_save = False
        self._stager_used = False

    def setup(self) -> None:
        options = self._options
        if options.own_group:
            self._group = dist.new_group(backend="gloo")
        if not options.reuse_stager:
            return
        if not torch.cuda.is_available():
            self.notes.append(
                "DefaultStager without pinned memory and non-blocking copies: StagingOptions "
                "needs CUDA for both (torch ignores use_pinned_memory and rejects "
                "use_non_blocking_copy without an accelerator)"
            )
        if not default_stager_survives_reuse():
            self._stager_per_save = True
            self.notes.append(
                f"a new DefaultStager per save: this torch ({torch.__version__}) clears a "
                "DefaultStager's copy table after each stage, so a reused one fails its "
                "second save (KeyError: <class 'type'>); its pinned buffers are not reused"
            )
        self._stager = self._make_stager()
        if options.async_staging and options.staging_wait == "before_optimizer_step":
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._hook = register_optimizer_step_pre_hook(self._wait_for_staging)

    def _make_stager(self):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        accelerator = torch.cuda.is_available()
        return DefaultStager(StagingOptions(
            use_pinned_memory=accelerator,
            use_shared_memory=self._options.executor == "process",
            use_async_staging=self._options.async_staging,
            use_non_blocking_copy=accelerator,
        ))

    def _wait_for_staging(self, *_args) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.result()

    def save(self, directory: str, index: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
        )

        options = self._options
        if self._stager_per_save and self._stager_used:
            self.wait()  # the previous save is durable before its stager goes
            self._stager.close()
            self._stager = self._make_stager()
        self._stager_used = self._stager is not None
        t_begin = self._begin()
        state_dict = self._source.dcp_state_dict()
        writer = dcp.FileSystemWriter(directory, thread_count=options.thread_count)
        t0 = now()
        self.timings.update(build_s=t0 - t_begin, t_start=t0)
        if options.executor == "sync":
            dcp.save(state_dict, storage_writer=writer, process_group=self._group)
            t2 = now()
            self.timings.update(t_stall_end=t2, t_end=t2, write_start=t0, write_end=t2)
            return
        kind = (AsyncCheckpointerType.PROCESS if options.executor == "process"
                else AsyncCheckpointerType.THREAD)
        response = dcp.async_save(state_dict, storage_writer=writer, async_checkpointer_type=kind,
                                  async_stager=self._stager, process_group=self._group)
        if isinstance(response, AsyncSaveResponse):
            if options.staging_wait == "in_stall":
                response.staging_completion.result()
            else:
                self._staging = response.staging_completion
            self._upload = response.upload_completion
        else:
            self._upload = response
        t2 = now()
        # DCP plans and writes in the background: its write span starts at the stall end.
        self.timings.update(t_stall_end=t2, write_start=t2)
        done: Dict[str, float] = self.timings
        self._upload.add_done_callback(lambda _f: done.setdefault("write_end", now()))

    def poll(self) -> bool:
        local = self._upload is None or self._upload.done()
        flag = torch.tensor([0 if local else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag[0]) == 0 and self._upload is not None:
            self._finish()  # raises a failed save
        return int(flag[0]) == 0

    def wait(self) -> None:
        if self._upload is not None:
            self._finish()

    def _finish(self) -> None:
        upload, self._upload = self._upload, None
        upload.result()
        t4 = now()
        self.timings.setdefault("write_end", t4)
        self.timings["t_end"] = t4

    def close(self) -> None:
        self.wait()
        if self._hook is not None:
            self._hook.remove()
        if self._stager is not None:
            self._stager.close()

