"""Options of one benchmark run, and the names of what it compares."""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Tuple

__all__ = [
    "BenchConfig",
    "OUR_VARIANTS",
    "DCP_VARIANTS",
    "MCORE_VARIANTS",
    "ALL_VARIANTS",
    "CHECKSUM_VARIANTS",
    "PRIORITY_VARIANTS",
    "WORKLOADS",
    "LOST_TIME_METHODS",
    "LOST_TIME_OUR_METHODS",
    "LOST_TIME_DCP_METHODS",
    "LOST_TIME_LOCAL_METHODS",
    "EXAMPLE_FLAGS",
    "parse_num_bytes",
    "format_num_bytes",
]

OUR_VARIANTS = ("ours_temporal", "ours_persistent")
"""Our strategy with a forked process per save, and with one persistent worker per rank."""

DCP_VARIANTS = (
    "dcp_save",
    "dcp_async_thread",
    "dcp_async_process",
    "dcp_async_thread_staged",
    "dcp_async_process_staged",
)
"""PyTorch DCP: synchronous ``save``; ``async_save`` with its thread and process executors,
each with the stager it creates per call and with a reused ``DefaultStager`` (async
staging; shared memory for the process executor; pinned memory where an accelerator is)."""

MCORE_VARIANTS = ("mcore_async_temporal", "mcore_async_persistent")
"""megatron-core's own ``torch_dist`` async save on its own ``AsyncCallsQueue``."""

ALL_VARIANTS = OUR_VARIANTS + DCP_VARIANTS + MCORE_VARIANTS

CHECKSUM_VARIANTS = ("ours_persistent_checksums", "ours_persistent_no_checksums")
"""Added by the benchmark itself when our save config has a checksum option: the
persistent caller with checksums opposite to their default."""

PRIORITY_VARIANTS = ("ours_temporal_trainer_priority", "ours_persistent_trainer_priority")
"""Opt-in (``--variants``): our callers with the background writer at the trainer's CPU
priority instead of the default lower one (``AsyncCallerConfig.writer_nice_increment``), to
measure what yielding to training buys in the GPT workload's "train step" column."""

WORKLOADS = ("synthetic", "gpt")

LOST_TIME_OUR_METHODS = ("ours_temporal", "ours_persistent", "ours_persistent_overlap")
"""The lost-time loop's methods on the GPT example's ``Checkpointer`` with our callers."""

LOST_TIME_DCP_METHODS = ("dcp_thread", "dcp_process", "dcp_async_staging")
"""The lost-time loop's DCP methods: ``async_save`` with a reused ``DefaultStager``
(synchronous staging) on its thread or process executor, and with asynchronous staging
waited for before the next optimizer step."""

LOST_TIME_LOCAL_METHODS = ("ours_local_f1", "ours_local_f2")
"""The lost-time loop's local-tier methods: the example's local checkpoint
(``Checkpointer.save(..., local=True)``) with the persistent caller, atomic algo, not
replicated (F = 1: what the local tier costs by itself) or replicated with F = 2 (J =
ranks / 2, each rank's part also on the rank J away: what replication adds); the launch
adds ``--non-persistent-local-ckpt-dir`` and ``--replication-jump`` (they depend on it)."""

LOST_TIME_METHODS = (("sync",) + LOST_TIME_OUR_METHODS + LOST_TIME_LOCAL_METHODS
                     + LOST_TIME_DCP_METHODS)

EXAMPLE_FLAGS = {
    "sync": [],
    "ours_temporal": ["--async-save", "--ckpt-assume-constant-structure"],
    "ours_persistent": ["--async-save", "--use-persistent-ckpt-worker",
                        "--ckpt-assume-constant-structure"],
    "ours_persistent_overlap": ["--async-save", "--use-persistent-ckpt-worker",
                                "--ckpt-assume-constant-structure", "--ckpt-overlap-staging"],
    "ours_local_f1": ["--async-save", "--use-persistent-ckpt-worker",
                      "--ckpt-assume-constant-structure", "--non-persistent-ckpt-type", "local",
                      "--non-persistent-local-ckpt-algo", "atomic"],
    "ours_local_f2": ["--async-save", "--use-persistent-ckpt-worker",
                      "--ckpt-assume-constant-structure", "--non-persistent-ckpt-type", "local",
                      "--non-persistent-local-ckpt-algo", "atomic", "--replication",
                      "--replication-factor", "2"],
}
"""The flags of ``examples/pretrain_gpt.py`` each example-driven lost-time method runs with."""

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
}


def parse_num_bytes(text: str) -> int:
    """Parse ``"256MiB"``, ``"32MB"``, ``"1GiB"`` or ``"1048576"`` into a number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size; write a number with an optional unit "
            "(B, KB, MB, GB, KiB, MiB, GiB), for example 256MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_num_bytes(num_bytes: float) -> str:
    """Render bytes with a binary unit, e.g. ``256.0 MiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything one ``tools/benchmark.py`` run does."""

    ranks: int = 2
    """Ranks (processes) of the main comparison."""

    bytes_per_rank: int = 256 * 2**20
    """Checkpoint payload each rank owns in the synthetic workload."""

    tensor_counts: Tuple[int, ...] = (100, 2000, 20000)
    """Tensors per rank of the synthetic workload, one comparison each (same total bytes)."""

    saves: int = 5
    """Consecutive saves per method and workload; the first is reported apart from the rest."""

    memory_saves: int = 10
    """Consecutive saves of our callers on the first synthetic workload, to check that host
    memory does not grow from save to save (at least ``saves``)."""

    dtype: str = "bfloat16"
    """Element type of the synthetic tensors (a ``torch`` dtype name)."""

    out_dir: str = "bench_out"
    """Where results.json, the plots and (unless ``ckpt_dir``) the checkpoints go."""

    ckpt_dir: Optional[str] = None
    """Checkpoint directory, on the filesystem to measure; default ``out_dir/ckpt``."""

    variants: Tuple[str, ...] = ALL_VARIANTS
    """Save methods to compare (see :data:`ALL_VARIANTS`)."""

    workloads: Tuple[str, ...] = WORKLOADS
    """Workloads to run: ``synthetic`` and/or ``gpt`` (the example's model and optimizer)."""

    gpt_num_layers: int = 4
    """GPT workload: transformer layers."""

    gpt_hidden_size: int = 512
    """GPT workload: hidden size (the parameter count grows with its square)."""

    scaling_ranks: Tuple[int, ...] = (1, 2, 4)
    """Rank counts of the rank-scaling sweep (our persistent caller and DCP async_save)."""

    scaling_tensor_count: Optional[int] = None
    """Tensors per rank in the rank-scaling sweep; default: the middle of ``tensor_counts``."""

    scaling_bytes_per_rank: Optional[int] = None
    """Bytes per rank in the rank-scaling sweep; default ``bytes_per_rank``."""

    thread_count: int = 2
    """Files (writer threads) per rank, for our writer and DCP's ``FileSystemWriter``."""

    threads_per_rank: int = 1
    """torch intra-op threads (``OMP_NUM_THREADS``) of every rank and its background
    processes. 1 is what torchrun sets for multi-process jobs; more threads than cores
    across ranks make every tensor copy spin-wait (OpenMP) and the timings meaningless."""

    train_step: bool = True
    """After scheduling each save, update every saved tensor in place once (what an
    optimizer step does), while the background write runs."""

    rss_interval_s: float = 0.02
    """Period of the resident-memory sampling thread on every rank."""

    launch_timeout_s: float = 1200.0
    """Bound on one launch (all saves of one method and workload)."""

    probe_bytes: Optional[int] = None
    """Bytes each rank writes and copies when measuring the physical limits; default
    ``bytes_per_rank``."""

    profile: bool = False
    """Profile the stall of rank 0 with pyinstrument in our callers' launches and keep the
    text reports under ``out_dir/profiles``."""

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"--ranks must be at least 1, got {self.ranks}")
        if self.bytes_per_rank < 1024:
            raise ValueError(f"--bytes-per-rank must be at least 1KiB, got {self.bytes_per_rank}")
        if not self.tensor_counts or min(self.tensor_counts) < 1:
            raise ValueError(f"--tensor-counts needs positive counts, got {self.tensor_counts}")
        if self.saves < 2:
            raise ValueError(
                f"--saves must be at least 2 (the first save is reported apart from the warm "
                f"ones), got {self.saves}"
            )
        if self.memory_saves < self.saves:
            raise ValueError(
                f"--memory-saves ({self.memory_saves}) must be at least --saves ({self.saves})"
            )
        known = set(ALL_VARIANTS) | set(CHECKSUM_VARIANTS) | set(PRIORITY_VARIANTS)
        unknown = sorted(set(self.variants) - known)
        if unknown:
            raise ValueError(
                f"unknown variants {unknown}; choose from {list(ALL_VARIANTS + PRIORITY_VARIANTS)}"
            )
        unknown = sorted(set(self.workloads) - set(WORKLOADS))
        if unknown:
            raise ValueError(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
        if any(r < 1 for r in self.scaling_ranks):
            raise ValueError(f"--scaling-ranks must be positive, got {self.scaling_ranks}")
        if self.thread_count < 1:
            raise ValueError(f"--thread-count must be at least 1, got {self.thread_count}")
        if self.threads_per_rank < 1:
            raise ValueError(f"--threads-per-rank must be at least 1, got {self.threads_per_rank}")
        if not self.rss_interval_s > 0:
            raise ValueError(f"--rss-interval-ms must be positive, got {self.rss_interval_s}")

    @property
    def checkpoint_root(self) -> str:
        """Directory the checkpoints are written under."""
        import os

        return self.ckpt_dir or os.path.join(self.out_dir, "ckpt")

    @property
    def scaling_count(self) -> int:
        """Tensors per rank of the rank-scaling sweep."""
        if self.scaling_tensor_count is not None:
            return self.scaling_tensor_count
        ordered = sorted(self.tensor_counts)
        return ordered[len(ordered) // 2]

    @property
    def scaling_bytes(self) -> int:
        """Bytes per rank of the rank-scaling sweep."""
        return self.scaling_bytes_per_rank or self.bytes_per_rank

    @property
    def limit_probe_bytes(self) -> int:
        """Bytes per rank of the physical-limit probes."""
        return self.probe_bytes or self.bytes_per_rank
