"""The lost-time part of ``tools/benchmark.py``: its options, its launches, its report.

Launching side. ``--lost-time`` adds it to a benchmark run, ``--lost-time-only`` runs
nothing else. One launch per method, rank count and model size (see :mod:`.lost_time`);
the results land under ``results.json["lost_time"]``, the tables and targets in
``report.md`` and the plot ``lost_time_vs_state_size.png``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Dict, List, Tuple

from .config import LOST_TIME_METHODS
from .lost_time_report import (
    aggregate_lost_time,
    draw_lost_time_plot,
    evaluate_lost_time_targets,
    format_lost_time,
    format_lost_time_targets,
)

__all__ = ["LostTimeOptions", "add_lost_time_arguments", "lost_time_options",
           "measure_lost_time", "render_lost_time"]


@dataclasses.dataclass(frozen=True)
class LostTimeOptions:
    """What the lost-time measurement runs."""

    mode: str = "off"
    """``off``, ``on`` (with the rest of the benchmark) or ``only``."""
    ranks: Tuple[int, ...] = (2, 1)
    hidden_sizes: Tuple[int, ...] = (256, 512)
    num_layers: int = 4
    saves: int = 4
    window: int = 4
    methods: Tuple[str, ...] = LOST_TIME_METHODS


def _ints(text: str) -> Tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _names(text: str) -> Tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_lost_time_arguments(parser) -> None:
    """The ``--lost-time*`` options of ``tools/benchmark.py``."""
    d = LostTimeOptions()
    group = parser.add_argument_group("lost time per checkpoint in a training loop")
    group.add_argument("--lost-time", action="store_true",
                       help="also measure training time lost per checkpoint (GPT example loop)")
    group.add_argument("--lost-time-only", action="store_true",
                       help="measure only the lost time (no limits, no other tables)")
    group.add_argument("--lost-time-ranks", type=_ints, default=",".join(map(str, d.ranks)))
    group.add_argument("--lost-time-hidden-sizes", type=_ints,
                       default=",".join(map(str, d.hidden_sizes)),
                       help="GPT hidden sizes (one state size each, for the plot)")
    group.add_argument("--lost-time-layers", type=int, default=d.num_layers)
    group.add_argument("--lost-time-saves", type=int, default=d.saves,
                       help="saves per launch (the first is reported with the set-up)")
    group.add_argument("--lost-time-window", type=int, default=d.window,
                       help="checkpoint-free iterations before each save")
    group.add_argument("--lost-time-methods", type=_names, default=",".join(d.methods))


def lost_time_options(args) -> LostTimeOptions:
    """Read the parsed ``--lost-time*`` options; raise ValueError on bad ones."""
    mode = "only" if args.lost_time_only else ("on" if args.lost_time else "off")
    options = LostTimeOptions(
        mode=mode, ranks=args.lost_time_ranks, hidden_sizes=args.lost_time_hidden_sizes,
        num_layers=args.lost_time_layers, saves=args.lost_time_saves,
        window=args.lost_time_window, methods=args.lost_time_methods)
    unknown = sorted(set(options.methods) - set(LOST_TIME_METHODS))
    if unknown:
        raise ValueError(f"unknown --lost-time-methods {unknown}; "
                         f"choose from {list(LOST_TIME_METHODS)}")
    if options.saves < 2:
        raise ValueError("--lost-time-saves must be at least 2 (the first is reported apart)")
    if options.window < 1:
        raise ValueError("--lost-time-window must be at least 1")
    if not options.ranks or min(options.ranks) < 1:
        raise ValueError("--lost-time-ranks needs positive rank counts")
    return options


def measure_lost_time(options: LostTimeOptions, checkpoint_root: str, timeout_s: float,
                      threads_per_rank: int, log_path: Callable[[str], str]) -> Dict[str, Any]:
    """Run every lost-time launch; return ``{"config", "runs"}`` (launching side)."""
    from .launch import LaunchError, launch
    from .lost_time import lost_time_job

    runs: List[Dict[str, Any]] = []
    for ranks in options.ranks:
        for hidden in options.hidden_sizes:
            print(f"lost time per checkpoint: {ranks} rank(s), GPT {options.num_layers} x "
                  f"{hidden}:", flush=True)
            for method in options.methods:
                tag = f"lost_{ranks}r_h{hidden}_{method}"
                meta = {"method": method, "ranks": ranks, "hidden_size": hidden}
                payload = {"method": method, "num_layers": options.num_layers,
                           "hidden_size": hidden, "saves": options.saves,
                           "window": options.window, "tag": tag,
                           "checkpoint_root": os.path.abspath(checkpoint_root)}
                if method == "ours_local_f2" and (ranks < 2 or ranks % 2):
                    runs.append(dict(meta, status="skipped", reason="replication with F = 2 "
                                     "needs an even number of ranks, 2 or more"))
                    print(f"  {method}: skipped ({ranks} rank(s))", flush=True)
                    continue
                started = time.monotonic()
                try:
                    values = launch(ranks, lost_time_job, payload, timeout_s, threads_per_rank,
                                    log_path(tag))
                    entry = aggregate_lost_time(meta, values)
                except LaunchError as exc:
                    entry = dict(meta, status="error", reason=str(exc)[-2000:])
                entry["launch_s"] = time.monotonic() - started
                runs.append(entry)
                if entry["status"] == "ok":
                    print(f"  {method}: lost {entry['lost_warm_s'] * 1e3:.0f} ms per warm save "
                          f"(stall {entry['stall_warm_s'] * 1e3:.0f} ms), first + set-up "
                          f"{entry['first_and_setup_s']:.2f} s ({entry['launch_s']:.0f} s)",
                          flush=True)
                else:
                    print(f"  {method}: error (see {log_path(tag)})", flush=True)
    return {"config": dataclasses.asdict(options), "runs": runs}


def render_lost_time(lost: Dict[str, Any], out_dir: str) -> List[str]:
    """Targets, plot and the report.md lines of the lost-time results (launching side)."""
    runs = lost["runs"]
    lost["targets"] = evaluate_lost_time_targets(runs)
    lost["plots"] = draw_lost_time_plot(runs, out_dir)
    config = lost["config"]
    lines = [
        "### Training time lost per checkpoint (GPT example loop, distributed Adam)", "",
        f"{config['saves']} saves per launch, each after {config['window']} checkpoint-free "
        "iterations. Lost time of a save = its stall + for every iteration from the save call "
        "until the checkpoint is durable, that iteration's time minus the median iteration "
        "time of the checkpoint-free windows (same launch, interleaved); \"lost warm\" is the "
        "median over the saves after the first; \"first save + set-up\" = the method's set-up "
        "call + the excess of the iterations right after it + the first save's lost time. "
        "Ratios: lost warm over one memory copy of the state (with CUDA: device to pinned "
        "host memory, staging's limit), over sync's and over each DCP row. `ours_local_f1` and "
        "`ours_local_f2` save local checkpoints (not replicated; replicated, F = 2) instead "
        "of persistent ones.", "",
        format_lost_time(runs, config["num_layers"]), "",
        "#### Lost-time targets (reported, never asserted)", "",
        format_lost_time_targets(lost["targets"]), "",
    ]
    errors = [f"- `{r['method']}` ({r['ranks']} rank(s), hidden {r['hidden_size']}): "
              f"{r['status']}: {r['reason'].strip().splitlines()[-1] if r['reason'] else ''}"
              for r in runs if r["status"] != "ok"]
    if errors:
        lines += ["Lost-time launches that failed or were skipped:", ""] + errors + [""]
    lines += [f"![Lost time per save against state size]({os.path.basename(p)})"
              for p in lost["plots"]] + [""]
    return lines
