"""The stall and throughput part of ``tools/benchmark.py``: its launches (launching side).

:func:`measure_stall` runs, one launch each (:mod:`.launch`, the rank side in
:mod:`.rank_job`), every method on the synthetic workload per tensor count and on the GPT
example, then the rank-count sweep, with the physical limits measured at the start and at
the end (:mod:`.probes`) and the extra measurements asked for (:mod:`.extras`). It prints
one progress line per launch and returns the raw results that ``results.json`` holds;
the report is drawn from them afterwards (:mod:`.report`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from typing import Any, Dict, List

from .config import MCORE_VARIANTS, OUR_VARIANTS, BenchConfig, format_num_bytes
from .extras import ExtraMeasurements
from .report import format_limits, run_label, summarize_failure
from .results import aggregate_run

__all__ = ["log_path", "measure_stall"]

_SCALING_VARIANTS = ("ours_temporal", "ours_persistent", "dcp_async_thread")


def _host_info() -> Dict[str, Any]:
    import psutil
    import torch

    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # best effort: only informative
        mcore = "unknown"
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": mcore,
        "cuda": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "load_average_start": os.getloadavg(),
    }


class _Runner:
    """Runs the launches of one benchmark, keeping every run's entry (the launching side)."""

    def __init__(self, config: BenchConfig):
        self.config = config
        self.runs: List[Dict[str, Any]] = []
        self._unsupported: Dict[str, str] = {}

    def run(self, variant: str, workload: str, ranks: int, tensor_count: int,
            bytes_per_rank: int, saves: int, sweep: str) -> Dict[str, Any]:
        from .launch import LaunchError, launch
        from .rank_job import variant_job

        cfg = self.config
        meta = {"variant": variant, "workload": workload, "ranks": ranks,
                "tensor_count": tensor_count, "bytes_per_rank": bytes_per_rank,
                "saves_requested": saves, "sweep": sweep}
        if variant in self._unsupported:
            entry = dict(meta, status="unsupported", reason=self._unsupported[variant], notes=[])
            self.runs.append(entry)
            return entry
        tag = f"{sweep}_{workload}_{tensor_count}t_{ranks}r_{variant}"
        payload = {
            "variant": variant, "workload": workload, "bytes_per_rank": bytes_per_rank,
            "tensor_count": tensor_count, "dtype": cfg.dtype, "saves": saves,
            "gpt_num_layers": cfg.gpt_num_layers, "gpt_hidden_size": cfg.gpt_hidden_size,
            "train_step": cfg.train_step, "thread_count": cfg.thread_count,
            "rss_interval_s": cfg.rss_interval_s,
            "checkpoint_root": os.path.abspath(cfg.checkpoint_root), "tag": tag,
            "profile_dir": (os.path.join(os.path.abspath(cfg.out_dir), "profiles")
                            if cfg.profile and variant in OUR_VARIANTS else None),
        }
        started = time.monotonic()
        try:
            values = launch(ranks, variant_job, payload, cfg.launch_timeout_s,
                            cfg.threads_per_rank, log_path(cfg, tag, truncate=True))
            entry = aggregate_run(meta, values)
        except LaunchError as exc:
            entry = dict(meta, status="error", reason=str(exc), notes=[],
                         log=log_path(cfg, tag))
        entry["launch_s"] = time.monotonic() - started
        if entry["status"] == "unsupported" and variant in MCORE_VARIANTS:
            self._unsupported[variant] = entry["reason"]
        self.runs.append(entry)
        _print_progress(entry)
        return entry


def log_path(config: BenchConfig, tag: str, truncate: bool = False) -> str:
    """``OUT/logs/TAG.log``: the ranks' output of one launch (emptied before it starts)."""
    directory = os.path.join(config.out_dir, "logs")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{tag}.log")
    if truncate:
        open(path, "w").close()
    return path


def _print_progress(entry: Dict[str, Any]) -> None:
    what = f"{entry['variant']} ({run_label(entry)})"
    if entry["status"] != "ok":
        print(f"  {what}: {entry['status']}: {summarize_failure(entry['reason'])[:200]}",
              flush=True)
        return
    warm, first = entry["warm"], entry["first"]
    write = warm.get("write_bytes_per_s")
    print(f"  {what}: stall 1st {first['stall_s'] * 1e3:.0f} ms, warm {warm['stall_s'] * 1e3:.0f}"
          f" ms; write {write / 1e9 if write else float('nan'):.2f} GB/s; e2e "
          f"{warm['e2e_s'] * 1e3:.0f} ms ({entry['launch_s']:.0f} s)", flush=True)


def _measure_limits(config: BenchConfig, when: str) -> Dict[str, float]:
    from .launch import launch
    from .probes import limits_job

    os.makedirs(config.checkpoint_root, exist_ok=True)
    payload = {"num_bytes": config.limit_probe_bytes,
               "directory": os.path.abspath(config.checkpoint_root)}
    return launch(config.ranks, limits_job, payload, config.launch_timeout_s,
                  config.threads_per_rank, log_path(config, f"limits_{when}", truncate=True))[0]


def _command() -> str:
    return " ".join([os.path.basename(sys.executable)] + sys.argv)


def measure_stall(config: BenchConfig, extras: ExtraMeasurements) -> Dict[str, Any]:
    """Run every launch of the benchmark; return the raw results (launching side).

    With an ``only`` extra (``--lost-time-only``, ``--local-recovery-only``) only the
    extras are measured.
    """
    from .methods.queue import checksum_option, checksum_variant
    from .workloads import gpt_example_status

    started = time.monotonic()
    host = _host_info()
    if extras.only:
        measured = _measure_extras(config, extras)
        host["load_average_end"] = os.getloadavg()
        host["elapsed_s"] = time.monotonic() - started
        return {"command": _command(), "config": dataclasses.asdict(config), "host": host,
                **measured}
    print(f"benchmark: {config.ranks} ranks, {format_num_bytes(config.bytes_per_rank)}/rank, "
          f"tensor counts {list(config.tensor_counts)}, {config.saves} saves "
          f"({config.memory_saves} for ours), load average "
          f"{', '.join(f'{v:.2f}' for v in host['load_average_start'])}",
          flush=True)
    limits_start = _measure_limits(config, "start")
    print(format_limits([limits_start]), flush=True)

    variants = list(config.variants)
    option = checksum_option()
    checksums = {"status": "skipped", "reason": "TorchDistSaveConfig has no checksum option yet "
                 "(the writer does not compute checksums), so there is no with/without column"}
    if option is not None and "ours_persistent" in variants:
        variants.append(checksum_variant())
        checksums = {"status": "measured", "option": option[0], "default": option[1],
                     "variant": checksum_variant()}
    elif option is not None:
        checksums["reason"] = "ours_persistent is not among --variants"

    runner = _Runner(config)
    if "synthetic" in config.workloads:
        for count in config.tensor_counts:
            print(f"synthetic workload, {count} tensors per rank:", flush=True)
            for variant in variants:
                saves = config.memory_saves if variant.startswith("ours") else config.saves
                runner.run(variant, "synthetic", config.ranks, count, config.bytes_per_rank,
                           saves, "main")

    gpt = {"status": "not requested"}
    if "gpt" in config.workloads:
        status = gpt_example_status()
        gpt = {"status": "ok" if status == "ok" else "unavailable", "reason": status}
        if status == "ok":
            print("GPT example workload:", flush=True)
            for variant in variants:
                runner.run(variant, "gpt", config.ranks, 0, 0, config.saves, "main")
        else:
            print(f"GPT workload skipped: {status}", flush=True)

    if "synthetic" in config.workloads:
        _sweep_ranks(config, variants, runner)

    measured = _measure_extras(config, extras)

    # Measured again at the end: the machine and disk may be shared, so the best of the two
    # is taken as the limit.
    limits_end = _measure_limits(config, "end")
    host["load_average_end"] = os.getloadavg()
    host["elapsed_s"] = time.monotonic() - started
    return {
        "command": _command(),
        "config": dataclasses.asdict(config),
        "host": host,
        "limits_measured": {"start": limits_start, "end": limits_end},
        "runs": runner.runs,
        "checksums": checksums,
        "gpt": gpt,
        **measured,
    }


def _sweep_ranks(config: BenchConfig, variants: List[str], runner: _Runner) -> None:
    """The rank-count sweep; a main run of the same size is reused, not launched again."""
    print(f"rank scaling, {config.scaling_count} tensors per rank:", flush=True)
    for ranks in config.scaling_ranks:
        for variant in (v for v in _SCALING_VARIANTS if v in variants):
            reuse = next((r for r in runner.runs if r["sweep"] == "main"
                          and r["workload"] == "synthetic" and r["variant"] == variant
                          and r["ranks"] == ranks and r["tensor_count"] == config.scaling_count
                          and r["bytes_per_rank"] == config.scaling_bytes), None)
            if reuse is not None:
                runner.runs.append(dict(reuse, sweep="ranks"))
                continue
            runner.run(variant, "synthetic", ranks, config.scaling_count,
                       config.scaling_bytes, config.saves, "ranks")


def _measure_extras(config: BenchConfig, extras: ExtraMeasurements) -> Dict[str, Any]:
    """The lost-time and local-recovery launches asked for, logged under ``OUT/logs``."""
    return extras.measure(config, lambda tag: log_path(config, tag, True))
