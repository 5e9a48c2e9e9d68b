"""Which save method each name of the benchmarks stands for (every rank).

The stall and throughput benchmark names its methods *variants*
(:data:`~..config.ALL_VARIANTS` and the added ones); the lost-time loop names them
:data:`~..config.LOST_TIME_METHODS`. Both get instances of the one hierarchy of
:mod:`.base`.
"""

from __future__ import annotations

import os
from typing import Any, Dict

from ..config import (
    EXAMPLE_FLAGS,
    LOST_TIME_LOCAL_METHODS,
    LOST_TIME_METHODS,
    OUR_VARIANTS,
    PRIORITY_VARIANTS,
)
from ..gpt_example import ExampleTrainer
from .base import SaveMethod
from .dcp import DcpOptions, DcpSave
from .example import ExampleCheckpointerSave
from .queue import McoreQueueSave, OurQueueSave

__all__ = ["build_variant", "build_lost_time_method"]

_CHECKSUM_VARIANTS = {"ours_persistent_checksums": True, "ours_persistent_no_checksums": False}
"""Our persistent caller with the checksum option forced on or off (the opposite of its
default, so that the default run and this one give the with/without comparison)."""

_LOST_TIME_THREAD_COUNT = 2
"""DCP's files per rank in the lost-time loop (the example writes two as well)."""


def build_variant(name: str, payload: Dict[str, Any], workload, stamp_dir: str) -> SaveMethod:
    """Create the method a stall-benchmark variant stands for, saving ``workload``."""
    threads = payload["thread_count"]
    if name in OUR_VARIANTS or name in PRIORITY_VARIANTS or name in _CHECKSUM_VARIANTS:
        profile_dir = payload.get("profile_dir")
        profile_path = None if profile_dir is None else os.path.join(
            profile_dir, f"{name}_{workload.name}_{workload.tensor_count}t_save{{index}}.txt")
        return OurQueueSave(
            name, workload, stamp_dir, persistent=not name.startswith("ours_temporal"),
            thread_count=threads, checksums=_CHECKSUM_VARIANTS.get(name),
            profile_path=profile_path, trainer_priority=name in PRIORITY_VARIANTS,
        )
    if name.startswith("mcore_async_"):
        return McoreQueueSave(name, workload, stamp_dir, persistent=name.endswith("persistent"))
    if name == "dcp_save":
        return DcpSave(name, workload, DcpOptions(executor="sync", thread_count=threads))
    if name.startswith("dcp_async_"):
        executor = "process" if "process" in name else "thread"
        options = DcpOptions(executor=executor, thread_count=threads,
                             reuse_stager=name.endswith("_staged"))
        return DcpSave(name, workload, options)
    raise ValueError(f"unknown save method {name!r}")


def build_lost_time_method(name: str, trainer: ExampleTrainer) -> SaveMethod:
    """Create the method a lost-time name stands for, saving ``trainer``'s state."""
    if name in EXAMPLE_FLAGS:
        return ExampleCheckpointerSave(name, trainer, local=name in LOST_TIME_LOCAL_METHODS)
    if name == "dcp_async_staging":
        options = DcpOptions(executor="thread", thread_count=_LOST_TIME_THREAD_COUNT,
                             reuse_stager=True, async_staging=True,
                             staging_wait="before_optimizer_step", own_group=True)
    elif name in ("dcp_thread", "dcp_process"):
        options = DcpOptions(executor=name.split("_")[1], thread_count=_LOST_TIME_THREAD_COUNT,
                             reuse_stager=True, async_staging=False, own_group=True)
    else:
        raise ValueError(
            f"unknown lost-time method {name!r}; choose from {list(LOST_TIME_METHODS)}")
    return DcpSave(name, trainer, options)
