"""Benchmark the training stall and write throughput of async checkpoint saves.

One command measures, on this machine and disk, in one run:

* the physical limits: memory copy bandwidth and sequential write + fsync bandwidth;
* our strategy on our temporal and persistent callers, PyTorch DCP's ``save`` and
  ``async_save`` (thread and process executors, with and without a reused
  ``DefaultStager``), and megatron-core's own async save (reported as unsupported, with
  the reason, where it cannot run), on a synthetic sharded state dict for each tensor
  count and on the GPT example's model + optimizer;
* stall and planning time against the rank count.

Example::

    python tools/benchmark.py --ranks 2 --bytes-per-rank 256MiB \\
        --tensor-counts 100,2000,20000 --saves 5 --dtype bfloat16 --out bench_out/

It prints the tables, and writes ``results.json``, ``report.md`` and PNG plots into
``--out``. Timings are never asserted: the targets are reported as PASS/MISS.
``--lost-time`` and ``--local-recovery`` (or ``--lost-time-only``, ``--local-recovery-only``)
add the training time lost per checkpoint and the recovery after a lost node from local
replicas (with the local save's host memory).
``python tools/benchmark.py --object-store ...`` (first argument) runs the object-store
row instead: our async save to an S3 endpoint against boto3 (``tools/bench/object_store.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from bench.extras import ExtraMeasurements, add_extra_arguments, render_extras
from bench.config import (
    ALL_VARIANTS,
    MCORE_VARIANTS,
    OUR_VARIANTS,
    WORKLOADS,
    BenchConfig,
    format_num_bytes,
    parse_num_bytes,
)

EXTRAS = ExtraMeasurements()
"""The ``--lost-time*`` and ``--local-recovery*`` options of this run (set by
:func:`parse_args`)."""

_SCALING_VARIANTS = ("ours_temporal", "ours_persistent", "dcp_async_thread")


def _int_list(text: str):
    return tuple(int(v) for v in text.split(",") if v.strip())


def _name_list(text: str):
    return tuple(v.strip() for v in text.split(",") if v.strip())


def parse_args(argv=None) -> Tuple[BenchConfig, Optional[str]]:
    """Read the command line: the run's :class:`BenchConfig`, and ``--from-results``."""
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, default=defaults.ranks)
    parser.add_argument("--bytes-per-rank", type=parse_num_bytes, default="256MiB")
    parser.add_argument("--tensor-counts", type=_int_list, default="100,2000,20000")
    parser.add_argument("--saves", type=int, default=defaults.saves)
    parser.add_argument("--memory-saves", type=int, default=defaults.memory_saves,
                        help="saves of our callers on the synthetic workloads (memory growth)")
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--out", default=defaults.out_dir)
    parser.add_argument("--ckpt-dir", default=None,
                        help="where checkpoints are written (the disk measured); default OUT/ckpt")
    parser.add_argument("--variants", type=_name_list, default=",".join(ALL_VARIANTS))
    parser.add_argument("--workloads", type=_name_list, default=",".join(WORKLOADS))
    parser.add_argument("--gpt-num-layers", type=int, default=defaults.gpt_num_layers)
    parser.add_argument("--gpt-hidden-size", type=int, default=defaults.gpt_hidden_size)
    parser.add_argument("--scaling-ranks", type=_int_list, default="1,2,4")
    parser.add_argument("--scaling-tensor-count", type=int, default=None)
    parser.add_argument("--scaling-bytes-per-rank", type=parse_num_bytes, default=None)
    parser.add_argument("--thread-count", type=int, default=defaults.thread_count,
                        help="files (writer threads) per rank")
    parser.add_argument("--threads-per-rank", type=int, default=defaults.threads_per_rank,
                        help="torch intra-op threads per rank (torchrun's default: 1)")
    parser.add_argument("--no-train-step", action="store_true",
                        help="do not update the tensors in place while the write runs")
    parser.add_argument("--rss-interval-ms", type=float, default=defaults.rss_interval_s * 1e3)
    parser.add_argument("--probe-bytes", type=parse_num_bytes, default=None)
    parser.add_argument("--launch-timeout-s", type=float, default=defaults.launch_timeout_s)
    parser.add_argument("--profile", action="store_true",
                        help="pyinstrument reports of rank 0's stall in our callers' runs")
    parser.add_argument("--from-results", default=None, metavar="RESULTS_JSON",
                        help="measure nothing: redo the targets, tables and plots of an earlier "
                        "run's results.json into --out")
    add_extra_arguments(parser)
    args = parser.parse_args(argv)
    if args.from_results is not None:
        return BenchConfig(out_dir=args.out), args.from_results
    try:
        global EXTRAS
        EXTRAS = ExtraMeasurements.from_args(args)
        return BenchConfig(
            ranks=args.ranks, bytes_per_rank=args.bytes_per_rank,
            tensor_counts=args.tensor_counts, saves=args.saves,
            memory_saves=max(args.memory_saves, args.saves), dtype=args.dtype,
            out_dir=args.out, ckpt_dir=args.ckpt_dir, variants=args.variants,
            workloads=args.workloads, gpt_num_layers=args.gpt_num_layers,
            gpt_hidden_size=args.gpt_hidden_size, scaling_ranks=args.scaling_ranks,
            scaling_tensor_count=args.scaling_tensor_count,
            scaling_bytes_per_rank=args.scaling_bytes_per_rank, thread_count=args.thread_count,
            threads_per_rank=args.threads_per_rank,
            train_step=not args.no_train_step, rss_interval_s=args.rss_interval_ms / 1e3,
            launch_timeout_s=args.launch_timeout_s, probe_bytes=args.probe_bytes,
            profile=args.profile,
        ), None
    except ValueError as exc:
        parser.error(str(exc))


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

    def log_path(self, tag: str) -> str:
        """Where the ranks of one launch write their output (``OUT/logs/TAG.log``)."""
        return _log_path(self.config, tag)

    def run(self, variant: str, workload: str, ranks: int, tensor_count: int,
            bytes_per_rank: int, saves: int, sweep: str) -> Dict[str, Any]:
        from bench.launch import LaunchError, launch
        from bench.rank_job import variant_job
        from bench.report import aggregate_run

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
                            cfg.threads_per_rank, _log_path(cfg, tag, truncate=True))
            entry = aggregate_run(meta, values)
        except LaunchError as exc:
            entry = dict(meta, status="error", reason=str(exc), notes=[],
                         log=self.log_path(tag))
        entry["launch_s"] = time.monotonic() - started
        if entry["status"] == "unsupported" and variant in MCORE_VARIANTS:
            self._unsupported[variant] = entry["reason"]
        self.runs.append(entry)
        _print_progress(entry)
        return entry


def _log_path(config: BenchConfig, tag: str, truncate: bool = False) -> str:
    """``OUT/logs/TAG.log``: the ranks' output of one launch (emptied before it starts)."""
    directory = os.path.join(config.out_dir, "logs")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{tag}.log")
    if truncate:
        open(path, "w").close()
    return path


def _run_label(run: Dict[str, Any]) -> str:
    if run["workload"] == "gpt":
        return f"gpt, {run['ranks']} ranks"
    return f"{run['tensor_count']} tensors/rank, {run['ranks']} ranks"


def _summarize(reason: str) -> str:
    """The most telling line of a failure: a rank's error, else the last traceback line."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    for line in lines:
        if re.match(r"rank \d+ \[", line):
            return line
    return lines[-1] if lines else ""


def _print_progress(entry: Dict[str, Any]) -> None:
    what = f"{entry['variant']} ({_run_label(entry)})"
    if entry["status"] != "ok":
        print(f"  {what}: {entry['status']}: {_summarize(entry['reason'])[:200]}", flush=True)
        return
    warm, first = entry["warm"], entry["first"]
    write = warm.get("write_bytes_per_s")
    print(f"  {what}: stall 1st {first['stall_s'] * 1e3:.0f} ms, warm {warm['stall_s'] * 1e3:.0f}"
          f" ms; write {write / 1e9 if write else float('nan'):.2f} GB/s; e2e "
          f"{warm['e2e_s'] * 1e3:.0f} ms ({entry['launch_s']:.0f} s)", flush=True)


def _measure_limits(config: BenchConfig, when: str) -> Dict[str, float]:
    from bench.launch import launch
    from bench.probes import limits_job

    os.makedirs(config.checkpoint_root, exist_ok=True)
    payload = {"num_bytes": config.limit_probe_bytes,
               "directory": os.path.abspath(config.checkpoint_root)}
    return launch(config.ranks, limits_job, payload, config.launch_timeout_s,
                  config.threads_per_rank, _log_path(config, f"limits_{when}", truncate=True))[0]


def _measure(config: BenchConfig) -> Dict[str, Any]:
    """Run every launch of the benchmark; return the raw results (launching side)."""
    from bench import report
    from bench.methods.queue import checksum_option, checksum_variant
    from bench.workloads import gpt_example_status

    started = time.monotonic()
    host = _host_info()
    if EXTRAS.only:
        extras = _measure_extras(config)
        host["load_average_end"] = os.getloadavg()
        host["elapsed_s"] = time.monotonic() - started
        return {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "config": dataclasses.asdict(config), "host": host, **extras}
    print(f"benchmark: {config.ranks} ranks, {format_num_bytes(config.bytes_per_rank)}/rank, "
          f"tensor counts {list(config.tensor_counts)}, {config.saves} saves "
          f"({config.memory_saves} for ours), load average "
          f"{', '.join(f'{v:.2f}' for v in host['load_average_start'])}",
          flush=True)
    limits_start = _measure_limits(config, "start")
    print(report.format_limits([limits_start]), flush=True)

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

    extras = _measure_extras(config)

    # Measured again at the end: the machine and disk may be shared, so the best of the two
    # is taken as the limit.
    limits_end = _measure_limits(config, "end")
    host["load_average_end"] = os.getloadavg()
    host["elapsed_s"] = time.monotonic() - started
    return {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "config": dataclasses.asdict(config),
        "host": host,
        "limits_measured": {"start": limits_start, "end": limits_end},
        "runs": runner.runs,
        "checksums": checksums,
        "gpt": gpt,
        **extras,
    }


def _measure_extras(config: BenchConfig) -> Dict[str, Any]:
    """The lost-time and local-recovery launches asked for, logged under ``OUT/logs``."""
    return EXTRAS.measure(config, lambda tag: _log_path(config, tag, True))


def _config_of(results: Dict[str, Any], out_dir: str) -> BenchConfig:
    """The configuration an earlier results.json was measured with, writing into ``out_dir``."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in results["config"].items()}
    return BenchConfig(**dict(fields, out_dir=out_dir))


def _write_outputs(config: BenchConfig, results: Dict[str, Any]) -> None:
    """Evaluate the targets, draw the plots, write results.json and report.md, print."""
    from bench import report

    if "runs" not in results:  # --lost-time-only, --local-recovery-only
        lines = _lost_time_header(results) + render_extras(results, config.out_dir)
        _write_report(config, results, "\n".join(lines))
        return
    measured = results["limits_measured"]
    limits = report.combine_limits([measured["start"], measured["end"]])
    variants = {run["variant"] for run in results["runs"]}
    results["limits"] = limits
    results["targets"] = report.evaluate_targets(
        results["runs"], limits, config.ranks, [v for v in OUR_VARIANTS if v in variants])
    results["plots"] = report.draw_plots(results["runs"], limits, config.ranks, config.out_dir)
    markdown = _render_markdown(config, results, report)
    markdown += "\n" + "\n".join(render_extras(results, config.out_dir))
    _write_report(config, results, markdown)


def _lost_time_header(results: Dict[str, Any]) -> List[str]:
    host = results["host"]
    load = {when: ", ".join(f"{v:.2f}" for v in host[f"load_average_{when}"])
            for when in ("start", "end")}
    return [f"Load average (1, 5, 15 min) at start {load['start']}, at end {load['end']}; "
            f"{host['cpu_count']} CPUs; torch {host['torch']}, "
            f"megatron-core {host['megatron_core']}; CUDA: {host['cuda']}.", ""]


def _write_report(config: BenchConfig, results: Dict[str, Any], markdown: str) -> None:
    """Write report.md and results.json, and print the report."""
    with open(os.path.join(config.out_dir, "report.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(config.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    plots = len(results.get("plots", [])) + len(results.get("lost_time", {}).get("plots", []))
    print(markdown)
    print(f"wrote {config.out_dir}/results.json, report.md and {plots} plot(s)", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--object-store"]:  # the object-store row: its own options (bench/object_store.py)
        from bench.object_store import main as object_store_main

        return object_store_main(argv[1:])
    if argv[:1] == ["--scale"]:  # the coordinator at thousands of ranks, simulated (bench/scale.py)
        from bench.scale import main as scale_main

        scale_main(argv[1:])
        return 0
    config, from_results = parse_args(argv)
    if from_results is not None:
        with open(from_results) as f:
            results = json.load(f)
        config = _config_of(results, config.out_dir)
    else:
        results = _measure(config)
    os.makedirs(config.out_dir, exist_ok=True)
    _write_outputs(config, results)
    return 0


def _collect_notes(runs: List[Dict[str, Any]]) -> List[str]:
    """One line per method and distinct note or failure, naming the runs it applies to."""
    seen: Dict[tuple, List[str]] = {}
    runs_of: Dict[str, set] = {}
    for run in runs:
        if run["sweep"] != "main" and run["status"] == "ok":
            continue
        runs_of.setdefault(run["variant"], set()).add(_run_label(run))
        texts = [f"{run['status']}: {_summarize(run['reason'])}"] if run["status"] != "ok" else []
        for text in texts + list(run.get("notes", [])):
            labels = seen.setdefault((run["variant"], text), [])
            if _run_label(run) not in labels:
                labels.append(_run_label(run))
    lines = []
    for (variant, text), labels in seen.items():
        where = "every run" if set(labels) == runs_of[variant] else "; ".join(labels)
        lines.append(f"- `{variant}` ({where}): {text}")
    return lines


def _render_markdown(config: BenchConfig, results: Dict[str, Any], report) -> str:
    """report.md: the limits, one table per workload, the targets, checksums, scaling, notes."""
    host, runs, targets = results["host"], results["runs"], results["targets"]
    checksums, gpt = results["checksums"], results["gpt"]
    limit_measurements = [results["limits_measured"]["start"], results["limits_measured"]["end"]]
    load = {when: ", ".join(f"{v:.2f}" for v in host[f"load_average_{when}"])
            for when in ("start", "end")}
    parts = [f"Load average (1, 5, 15 min) at start {load['start']}, at end {load['end']}; "
             f"{host['cpu_count']} CPUs; torch {host['torch']}, "
             f"megatron-core {host['megatron_core']}; CUDA: {host['cuda']}.", "",
             "### Physical limits", "", report.format_limits(limit_measurements), ""]
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for run in runs:
        if run["sweep"] == "main":
            groups.setdefault((run["workload"], run["tensor_count"]), []).append(run)
    for (workload, count), group in groups.items():
        sizes = next((r["num_bytes_per_rank"] for r in group if r.get("num_bytes_per_rank")), [])
        size = "/".join(format_num_bytes(b) for b in sorted(set(sizes))) or "?"
        title = (f"synthetic, {count} tensors per rank" if workload == "synthetic"
                 else f"GPT example ({config.gpt_num_layers} layers, hidden "
                      f"{config.gpt_hidden_size}, distributed Adam)")
        parts += [f"### {title}: {config.ranks} ranks, {size} per rank", "",
                  report.format_run_table(group), ""]
    parts += ["### Targets (our callers, synthetic workload)", "",
              "Measured ratio and verdict per caller and tensors per rank; the numbers behind "
              "each ratio are in results.json (`targets[].detail`).", "",
              report.format_targets(targets), ""]
    if checksums["status"] == "measured":
        parts += [f"### Checksums (`{checksums['option']}`, default "
                  f"{'on' if checksums['default'] else 'off'}): ours_persistent, warm saves", "",
                  report.format_checksums(runs, checksums["variant"], checksums["default"]), ""]
    scaling = [r for r in runs if r["sweep"] == "ranks"]
    if scaling:
        parts += ["### Stall and planning against the rank count", "",
                  report.format_scaling(scaling), ""]
    notes = _collect_notes(runs)
    if checksums["status"] != "measured":
        notes.append(f"- checksums: {checksums['status']}: {checksums['reason']}")
    notes.append(f"- GPT workload: {gpt['status']}" + (
        f" ({gpt['reason']})" if gpt.get("reason") not in (None, "ok") else ""))
    parts += ["### Notes", ""] + notes + [""]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
