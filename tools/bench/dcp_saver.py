"""PyTorch DCP as a save method of the benchmark (every rank).

DCP's ``async_save`` plans and writes in its background thread or process, so its stall
is only staging: until ``async_save`` returns and, with asynchronous staging, until
staging is complete (the training step changes the tensors in place, so it must wait).
"""

from __future__ import annotations

import time
from typing import Any, Dict

import torch

from .savers import Saver
from .workloads import Workload

__all__ = ["DcpSaver"]


class DcpSaver(Saver):
    """PyTorch DCP: ``save``, or ``async_save`` with a thread or process executor.

    Args:
        mode: ``"sync"``, ``"thread"`` or ``"process"``.
        reuse_stager: pass one ``DefaultStager`` kept across saves (async staging; shared
            memory for the process executor; pinned memory and non-blocking copies where
            an accelerator is) instead of letting each call stage a fresh copy.
        thread_count: ``FileSystemWriter`` threads (files) per rank.
    """

    def __init__(self, name: str, train_step: bool, stamp_dir: str, *, mode: str,
                 reuse_stager: bool, thread_count: int):
        super().__init__(name, train_step, stamp_dir)
        self._mode = mode
        self._reuse_stager = reuse_stager
        self._thread_count = thread_count
        self._stager = None

    def setup(self) -> None:
        if not self._reuse_stager:
            return
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        accelerator = torch.cuda.is_available()
        if not accelerator:
            self.notes.append(
                "DefaultStager without pinned memory and non-blocking copies: StagingOptions "
                "needs CUDA for both (torch ignores use_pinned_memory and rejects "
                "use_non_blocking_copy without an accelerator)"
            )
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=accelerator,
                use_shared_memory=self._mode == "process",
                use_async_staging=True,
                use_non_blocking_copy=accelerator,
            )
        )

    def save(self, workload: Workload, checkpoint_dir: str, index: int) -> Dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
        )

        t_begin = time.monotonic()
        state_dict = workload.dcp_state_dict()
        writer = dcp.FileSystemWriter(checkpoint_dir, thread_count=self._thread_count)
        t0 = time.monotonic()
        if self._mode == "sync":
            dcp.save(state_dict, storage_writer=writer)
            t2 = time.monotonic()
            train_s = self._maybe_train(workload)
            return {
                "build_s": t0 - t_begin, "plan_s": None, "strategy_plan_s": None,
                "stage_s": None, "stall_s": t2 - t0, "train_step_s": train_s,
                "finalize_s": 0.0, "e2e_s": t2 - t0, "t_start": t0, "t_stall_end": t2,
                "write_start": t0, "write_end": t2, "reused_plans": False,
            }
        kind = (AsyncCheckpointerType.PROCESS if self._mode == "process"
                else AsyncCheckpointerType.THREAD)
        response = dcp.async_save(
            state_dict, storage_writer=writer, async_checkpointer_type=kind,
            async_stager=self._stager,
        )
        if isinstance(response, AsyncSaveResponse):
            response.staging_completion.result()
            future = response.upload_completion
        else:
            future = response
        t2 = time.monotonic()
        done: Dict[str, float] = {}
        future.add_done_callback(lambda _f: done.setdefault("at", time.monotonic()))
        train_s = self._maybe_train(workload)
        future.result()
        t4 = time.monotonic()
        return {
            "build_s": t0 - t_begin, "plan_s": None, "strategy_plan_s": None,
            "stage_s": None, "stall_s": t2 - t0, "train_step_s": train_s,
            "finalize_s": 0.0, "e2e_s": t4 - t0, "t_start": t0, "t_stall_end": t2,
            # DCP plans and writes in the background: its write span starts at the stall end.
            "write_start": t2, "write_end": done.get("at", t4), "reused_plans": False,
        }

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
