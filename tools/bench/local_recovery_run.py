"""The local-recovery part of ``tools/benchmark.py``: its options, its launch, its report.

Launching side. ``--local-recovery`` adds it to a benchmark run, ``--local-recovery-only``
runs nothing else. One launch of ``--ranks`` ranks (an even number: two "nodes") with
``--bytes-per-rank`` of ``--dtype`` per rank in ``--local-recovery-tensors`` tensors (see
:mod:`.local_recovery`); the results land under ``results.json["local_recovery"]`` and
two tables in ``report.md``:

* recovery after a lost node: a restarted job's ``find_latest()`` + ``load()`` of the
  local tier (F = 2; the lost node's parts come from their replicas) against
  ``dist_checkpointing.load`` of the persistent checkpoint of the same state, with the
  page cache warm and cold. Each trial's time is the slowest rank's; the table shows the
  median over ``--local-recovery-repeats`` trials;
* host memory of one warm save with replication (``ours_local_f2``) and of
  ``ours_persistent``: the staging ledger's peak and the peak RSS growth of the trainer
  and of its background writer, each over the staging budget (one copy of the state);
  the largest over ranks.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

from .config import format_num_bytes

__all__ = ["LocalRecoveryOptions", "add_local_recovery_arguments", "local_recovery_options",
           "measure_local_recovery", "render_local_recovery"]

_MEMORY_KEYS = ("budget_bytes", "staging_peak_bytes", "trainer_rss_growth_bytes",
                "writer_rss_growth_bytes", "pss_after_bytes", "stall_s", "e2e_s")
_RECOVERY_KEYS = ("local_s", "local_find_latest_s", "local_load_s", "persistent_load_s")


@dataclasses.dataclass(frozen=True)
class LocalRecoveryOptions:
    """What the local-recovery measurement runs (sizes and ranks: the benchmark's own)."""

    mode: str = "off"
    """``off``, ``on`` (with the rest of the benchmark) or ``only``."""
    tensor_count: int = 64
    """Tensors per rank (the state is ``--bytes-per-rank`` in all)."""
    repeats: int = 3
    """Timed recoveries per page-cache condition and method."""


def add_local_recovery_arguments(parser) -> None:
    """The ``--local-recovery*`` options of ``tools/benchmark.py``."""
    d = LocalRecoveryOptions()
    group = parser.add_argument_group(
        "recovery after a lost node, and host memory of a replicated local save")
    group.add_argument("--local-recovery", action="store_true",
                       help="also measure local recovery (F = 2) against the persistent load, "
                       "and the local save's host memory (--ranks, even; --bytes-per-rank)")
    group.add_argument("--local-recovery-only", action="store_true",
                       help="measure only that (no limits, no other tables)")
    group.add_argument("--local-recovery-tensors", type=int, default=d.tensor_count,
                       help="tensors per rank of the state")
    group.add_argument("--local-recovery-repeats", type=int, default=d.repeats,
                       help="timed recoveries per page-cache condition")


def local_recovery_options(args) -> LocalRecoveryOptions:
    """Read the parsed ``--local-recovery*`` options; raise ValueError on bad ones."""
    mode = "only" if args.local_recovery_only else ("on" if args.local_recovery else "off")
    if mode != "off" and (args.ranks < 2 or args.ranks % 2):
        raise ValueError(f"--local-recovery needs an even --ranks, 2 or more (two nodes that "
                         f"replicate to each other with F = 2), got {args.ranks}")
    if args.local_recovery_tensors < 1 or args.local_recovery_repeats < 1:
        raise ValueError("--local-recovery-tensors and --local-recovery-repeats must be "
                         "at least 1")
    return LocalRecoveryOptions(mode=mode, tensor_count=args.local_recovery_tensors,
                                repeats=args.local_recovery_repeats)


def measure_local_recovery(options: LocalRecoveryOptions, config, log_path: Callable[[str], str]
                           ) -> Dict[str, Any]:
    """Run the launch (``config``: the benchmark's ``BenchConfig``); return its entry
    ``{"config", "status", ...}`` (launching side)."""
    from .launch import LaunchError, launch
    from .local_recovery import local_recovery_job

    tag = f"local_recovery_{config.ranks}r"
    payload = {"bytes_per_rank": config.bytes_per_rank, "tensor_count": options.tensor_count,
               "dtype": config.dtype, "repeats": options.repeats,
               "thread_count": config.thread_count, "rss_interval_s": config.rss_interval_s,
               "checkpoint_root": os.path.abspath(config.checkpoint_root), "tag": tag}
    entry: Dict[str, Any] = {"config": dict(dataclasses.asdict(options), ranks=config.ranks,
                                            bytes_per_rank=config.bytes_per_rank,
                                            dtype=config.dtype)}
    print(f"local recovery (F = 2) and local-save memory: {config.ranks} ranks, "
          f"{format_num_bytes(config.bytes_per_rank)}/rank:", flush=True)
    started = time.monotonic()
    try:
        values = launch(config.ranks, local_recovery_job, payload, config.launch_timeout_s,
                        config.threads_per_rank, log_path(tag))
        entry.update(aggregate_local_recovery(values))
    except LaunchError as exc:
        entry.update(status="error", reason=str(exc)[-2000:], log=log_path(tag))
    entry["launch_s"] = time.monotonic() - started
    if entry["status"] != "ok":
        print(f"  error (see {entry['log']})", flush=True)
    for row in entry.get("recovery", []):
        print(f"  {row['condition']}: local {row['local_s'] * 1e3:.0f} ms, persistent "
              f"{row['persistent_load_s'] * 1e3:.0f} ms ({row['local_over_persistent']:.2f}x)",
              flush=True)
    return entry


def aggregate_local_recovery(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The report's rows from every rank's result: the slowest rank per trial (median over
    trials) for recovery, the largest rank for memory."""
    recovery = []
    for condition in ranks[0]["recovery"]:
        row: Dict[str, Any] = {"condition": condition}
        for key in _RECOVERY_KEYS:
            per_trial = [max(values) for values in
                         zip(*(r["recovery"][condition][key] for r in ranks))]
            row[key] = statistics.median(per_trial)
            row[f"{key}_trials"] = per_trial
        row["local_over_persistent"] = row["local_s"] / row["persistent_load_s"]
        recovery.append(row)
    memory = []
    for index, record in enumerate(ranks[0]["memory"]):
        row = {"method": record["method"]}
        for key in _MEMORY_KEYS:
            row[key] = max(r["memory"][index][key] for r in ranks)
        for key in ("staging_peak_bytes", "trainer_rss_growth_bytes", "writer_rss_growth_bytes"):
            row[key.replace("_bytes", "_over_budget")] = row[key] / row["budget_bytes"]
        memory.append(row)
    return {"status": "ok", "num_bytes_per_rank": max(r["num_bytes"] for r in ranks),
            "evicted_files": ranks[0].get("evicted_files"), "recovery": recovery,
            "memory": memory}


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(row) + " |" for row in rows])


def render_local_recovery(entry: Dict[str, Any]) -> List[str]:
    """The report.md lines of the local-recovery results (launching side)."""
    config = entry["config"]
    lines = ["### Recovery after a lost node, and host memory of a local save (F = 2)", ""]
    if entry["status"] != "ok":
        reason = entry["reason"].strip().splitlines()
        return lines + [f"Not measured: {entry['status']}: {reason[-1] if reason else ''} "
                        f"(log: {entry.get('log')})", ""]
    size = format_num_bytes(entry["num_bytes_per_rank"])
    lines += [
        f"{config['ranks']} ranks as two nodes, {size} per rank ({config['tensor_count']} "
        f"{config['dtype']} tensors), saved once more after a first save, locally "
        "(`LocalCheckpointManager`, `CliqueReplicationStrategy.from_replication_params(J, 2)`, "
        "J = ranks / 2) and persistently (our async `torch_dist` save); then the second "
        "node's holder directories are deleted. Local = a fresh manager's `find_latest()` + "
        "`load()` (the lost parts come from the peers' replicas); persistent = megatron-"
        "core's `dist_checkpointing.load` of the same sharded state. Each trial is the "
        f"slowest rank's; median of {config['repeats']} trial(s). Warm: the files are in the "
        "page cache (just written or read); cold: fsync, then `posix_fadvise(DONTNEED)` on "
        f"every checkpoint file ({entry['evicted_files']} files) before each load: best "
        "effort, pages still mapped by a process stay cached.", ""]
    lines += _table(
        ["page cache", "local: find_latest + load", "(find_latest / load)",
         "persistent load", "local / persistent"],
        [[r["condition"], _ms(r["local_s"]),
          f"{_ms(r['local_find_latest_s'])} / {_ms(r['local_load_s'])}",
          _ms(r["persistent_load_s"]), f"{r['local_over_persistent']:.2f}x"]
         for r in entry["recovery"]]) + [""]
    lines += [
        "One warm save (the second), largest rank. Budget: the staging budget, by default one "
        "copy of the state. Staging peak: the most the process's `StagingLedger` held; "
        "RSS growth: peak RSS during the save minus the RSS just before it, for the trainer "
        "and for its background writer (the persistent worker), apart (shared pages count "
        "in both); PSS held: rank and background processes once the save is complete.", ""]
    lines += _table(
        ["method", "budget", "staging peak", "x budget", "trainer RSS growth", "x budget",
         "writer RSS growth", "x budget", "PSS held after", "stall", "save to durable"],
        [[r["method"], _mib(r["budget_bytes"]), _mib(r["staging_peak_bytes"]),
          f"{r['staging_peak_over_budget']:.2f}", _mib(r["trainer_rss_growth_bytes"]),
          f"{r['trainer_rss_growth_over_budget']:.2f}", _mib(r["writer_rss_growth_bytes"]),
          f"{r['writer_rss_growth_over_budget']:.2f}", _mib(r["pss_after_bytes"]),
          _ms(r["stall_s"]), _ms(r["e2e_s"])] for r in entry["memory"]]) + [""]
    return lines
