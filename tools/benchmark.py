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
This file is the command line and writes the outputs (launching side); the launches are
``bench/stall_run.py``'s, the numbers ``bench/results.py``'s, the tables
``bench/report.py``'s and the plots ``bench/stall_plots.py``'s.
``--lost-time`` and ``--local-recovery`` (or ``--lost-time-only``, ``--local-recovery-only``)
add the training time lost per checkpoint and the recovery after a lost node from local
replicas (with the local save's host memory).
``python tools/benchmark.py --object-store ...`` (first argument) runs the object-store
row instead: our async save to an S3 endpoint against boto3 (``tools/bench/object_store.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, Optional, Tuple

from bench.config import ALL_VARIANTS, OUR_VARIANTS, WORKLOADS, BenchConfig, parse_num_bytes
from bench.extras import ExtraMeasurements, add_extra_arguments, render_extras

EXTRAS = ExtraMeasurements()
"""The ``--lost-time*`` and ``--local-recovery*`` options of this run (set by
:func:`parse_args`)."""


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


def _config_of(results: Dict[str, Any], out_dir: str) -> BenchConfig:
    """The configuration an earlier results.json was measured with, writing into ``out_dir``."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in results["config"].items()}
    return BenchConfig(**dict(fields, out_dir=out_dir))


def _write_outputs(config: BenchConfig, results: Dict[str, Any]) -> None:
    """Evaluate the targets, draw the plots, write results.json and report.md, print."""
    from bench import report
    from bench.results import combine_limits, evaluate_targets
    from bench.stall_plots import draw_plots

    if "runs" not in results:  # --lost-time-only, --local-recovery-only
        lines = report.host_lines(results["host"]) + render_extras(results, config.out_dir)
        _write_report(config, results, "\n".join(lines))
        return
    measured = results["limits_measured"]
    limits = combine_limits([measured["start"], measured["end"]])
    variants = {run["variant"] for run in results["runs"]}
    results["limits"] = limits
    results["targets"] = evaluate_targets(
        results["runs"], limits, config.ranks, [v for v in OUR_VARIANTS if v in variants])
    results["plots"] = draw_plots(results["runs"], limits, config.ranks, config.out_dir)
    markdown = report.render_markdown(config, results)
    markdown += "\n" + "\n".join(render_extras(results, config.out_dir))
    _write_report(config, results, markdown)


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
        from bench.stall_run import measure_stall

        results = measure_stall(config, EXTRAS)
    os.makedirs(config.out_dir, exist_ok=True)
    _write_outputs(config, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
