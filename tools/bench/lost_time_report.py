"""Lost time per checkpoint: per-rank timings -> per-save numbers, targets, tables, plot.

Launching side. For one launch (method, ranks, model size), with per-iteration times
taken as the maximum over ranks:

* ``free iteration``: median iteration time of the free windows after the first one
  (the first follows the set-up and carries its background cost);
* ``lost`` of one save: its stall (max over ranks) plus, for every iteration of its save
  window, that iteration's time minus the free median, plus any blocking wait;
* ``lost warm``: the median over the saves after the first;
* ``first + set-up``: the set-up call, plus the excess of the first free window's
  iterations, plus the first save's lost time, plus the *spill-over*: what the later
  windows lost beyond ``lost warm`` per save and beyond the free median per free
  iteration (start-up work that outlasts the first window, such as a persistent worker
  still importing torch, slows those iterations; clamped at zero);
* ``background CPU / warm save``: CPU seconds of every rank's background processes
  during a save window, summed over ranks (median over the warm saves); ``finalize
  warm``: the poll that found the save durable, where it is finalized on the training
  thread (max over ranks);
* ``model build + warm-up``: building the model and optimizer and the three warm-up
  iterations (max over ranks). Our queue, with its worker, is created before the model
  (as the example and Megatron-LM do), so whatever that early start costs the trainer
  later (a worker still importing, pages copied on write) shows here, against the other
  rows of the same size.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence

from .config import (
    LOST_TIME_DCP_METHODS,
    LOST_TIME_LOCAL_METHODS,
    LOST_TIME_METHODS,
    LOST_TIME_OUR_METHODS,
    format_num_bytes,
)

__all__ = ["aggregate_lost_time", "evaluate_lost_time_targets", "format_lost_time",
           "format_lost_time_targets", "draw_lost_time_plot", "LOST_TIME_TARGETS"]

LOST_TIME_TARGETS = {
    "lost_vs_sync": "lost time per warm save <= 0.2 x sync's",
    "lost_vs_dcp_best": "lost time per warm save <= 0.5 x DCP's best row",
    "first_vs_sync": "first save + set-up <= 1.5 x sync's",
    "overlap_stall_vs_memcpy": "overlapped staging: warm stall <= 0.1 x one memory copy "
                               "of the state",
    "local_lost_vs_persistent": "local save: lost time per warm save <= 1.0 x "
                                "ours_persistent's",
    "local_stall_vs_persistent": "local save: warm stall <= 1.1 x ours_persistent's",
}


def _maxima(per_rank: Sequence[Sequence[float]]) -> List[float]:
    return [max(values) for values in zip(*per_rank)]


def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def aggregate_lost_time(meta: Dict[str, Any], ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One launch's entry: ``meta`` plus the numbers of the module docstring."""
    saves = len(ranks[0]["windows"])
    free_later: List[float] = []
    for index in range(1, saves):
        free_later += _maxima([r["windows"][index]["free"] for r in ranks])
    free = _median(free_later) or _median(_maxima([r["warmup"] for r in ranks]))
    records = []
    for index in range(saves):
        windows = [r["windows"][index] for r in ranks]
        save_iterations = _maxima([w["save"] for w in windows])
        stall = max(w["stall_s"] for w in windows)
        excess = sum(t - free for t in save_iterations) + max(w["blocking_wait_s"] for w in windows)
        record = {"stall_s": stall, "excess_s": excess, "lost_s": stall + excess,
                  "save_iterations": len(save_iterations)}
        if all("save_cpu" in w for w in windows):  # results of older runs lack these
            # The poll that found the save durable finalized it on the training thread.
            record["finalize_s"] = max(w["save_polls"][-1] if w["save_polls"] else 0.0
                                       for w in windows)
            record["background_cpu_s"] = sum(w["save_cpu"]["background_cpu_s"] for w in windows)
            record["save_window_s"] = stall + sum(save_iterations)
            record["save_cpu"] = windows[0]["save_cpu"]
            record["free_cpu"] = windows[0]["free_cpu"]
        records.append(record)
    setup = max(r["setup_s"] for r in ranks)
    build = None
    if all("build_s" in r for r in ranks):  # results of older runs lack it
        build = max(r["build_s"] + sum(r["warmup"]) for r in ranks)
    after_setup = sum(t - free for t in _maxima([r["windows"][0]["free"] for r in ranks]))
    warm = records[1:]
    lost_warm = _median([s["lost_s"] for s in warm])
    # Start-up work that outlasts the first window (a persistent worker still importing)
    # slows later iterations too: whatever the launch lost beyond its warm saves' median
    # is charged to the set-up.
    spill = sum(s["lost_s"] - lost_warm for s in warm) + sum(
        t - free for index in range(1, saves)
        for t in _maxima([r["windows"][index]["free"] for r in ranks]))
    return dict(
        meta, status="ok", reason="",
        num_bytes_per_rank=max(r["num_bytes"] for r in ranks),
        memcpy_s=max(r["memcpy_s"] for r in ranks),
        free_iteration_s=free, setup_s=setup, after_setup_excess_s=after_setup,
        saves=records,
        stall_first_s=records[0]["stall_s"],
        stall_warm_s=_median([s["stall_s"] for s in warm]),
        lost_warm_s=lost_warm,
        save_iterations_warm=_median([s["save_iterations"] for s in warm]),
        finalize_warm_s=_median([s["finalize_s"] for s in warm if "finalize_s" in s]),
        background_cpu_warm_s=_median([s["background_cpu_s"] for s in warm
                                       if "background_cpu_s" in s]),
        first_and_setup_s=setup + after_setup + records[0]["lost_s"] + max(spill, 0.0),
        setup_spill_s=spill,
        build_and_warmup_s=build,
    )


def _groups(entries: List[Dict[str, Any]]) -> Dict[tuple, Dict[str, Dict[str, Any]]]:
    groups: Dict[tuple, Dict[str, Dict[str, Any]]] = {}
    for entry in entries:
        groups.setdefault((entry["ranks"], entry["hidden_size"]), {})[entry["method"]] = entry
    return groups


def _ok(entry: Optional[Dict[str, Any]]) -> bool:
    return entry is not None and entry["status"] == "ok"


def _ratio(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


def evaluate_lost_time_targets(entries: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's targets for each of our rows, per rank count and model size."""
    rows = []
    for (ranks, hidden), group in sorted(_groups(entries).items()):
        sync = group.get("sync")
        dcp = [group[m] for m in LOST_TIME_DCP_METHODS if _ok(group.get(m))]
        best_dcp = min((e["lost_warm_s"] for e in dcp), default=None)
        persistent = group.get("ours_persistent")
        for method in LOST_TIME_OUR_METHODS + LOST_TIME_LOCAL_METHODS:
            entry = group.get(method)
            if not _ok(entry):
                continue
            if method in LOST_TIME_LOCAL_METHODS:  # against a persistent save of the same state
                checks = {
                    "local_lost_vs_persistent": (_ratio(entry["lost_warm_s"],
                                                        persistent["lost_warm_s"])
                                                 if _ok(persistent) else None, 1.0),
                    "local_stall_vs_persistent": (_ratio(entry["stall_warm_s"],
                                                         persistent["stall_warm_s"])
                                                  if _ok(persistent) else None, 1.1),
                }
            else:
                checks = {
                    "lost_vs_sync": (_ratio(entry["lost_warm_s"], sync["lost_warm_s"])
                                     if _ok(sync) else None, 0.2),
                    "lost_vs_dcp_best": (_ratio(entry["lost_warm_s"], best_dcp), 0.5),
                    "first_vs_sync": (_ratio(entry["first_and_setup_s"],
                                             sync["first_and_setup_s"])
                                      if _ok(sync) else None, 1.5),
                }
            if method == "ours_persistent_overlap":
                checks["overlap_stall_vs_memcpy"] = (
                    _ratio(entry["stall_warm_s"], entry["memcpy_s"]), 0.1)
            for target, (ratio, bound) in checks.items():
                verdict = "N/A" if ratio is None else ("PASS" if ratio <= bound else "MISS")
                rows.append({"target": target, "method": method, "ranks": ranks,
                             "hidden_size": hidden, "ratio": ratio, "bound": bound,
                             "verdict": verdict})
    return rows


def _s(value: Optional[float]) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * 1e3:.0f}ms" if abs(value) < 10 else f"{value:.1f}s"


def _x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3g}"


def _table(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def format_lost_time(entries: List[Dict[str, Any]], num_layers: int) -> str:
    """One table per rank count and model size: every method's lost time and its ratios."""
    parts = []
    for (ranks, hidden), group in sorted(_groups(entries).items()):
        size = next((format_num_bytes(e["num_bytes_per_rank"]) for e in group.values()
                     if _ok(e)), "?")
        free = next((e["free_iteration_s"] for e in group.values() if _ok(e)), None)
        memcpy = max((e["memcpy_s"] for e in group.values() if _ok(e)), default=None)
        sync = group.get("sync")
        header = ["method", "stall 1st", "stall warm", "iterations to durable", "lost warm",
                  "lost / memcpy", "lost / sync"]
        header += [f"lost / {m}" for m in LOST_TIME_DCP_METHODS]
        header += ["first save + set-up", "set-up call", "background CPU / warm save",
                   "finalize warm", "model build + warm-up"]
        rows = []
        for method in LOST_TIME_METHODS:
            entry = group.get(method)
            if entry is None:
                continue
            if not _ok(entry):
                rows.append([method, f"{entry['status']}: see notes"] + [""] * (len(header) - 2))
                continue
            lost = entry["lost_warm_s"]
            ratios = [_x(_ratio(lost, entry["memcpy_s"])),
                      _x(_ratio(lost, sync["lost_warm_s"]) if _ok(sync) else None)]
            ratios += [_x(_ratio(lost, group[m]["lost_warm_s"]) if _ok(group.get(m)) else None)
                       for m in LOST_TIME_DCP_METHODS]
            rows.append([method, _s(entry["stall_first_s"]), _s(entry["stall_warm_s"]),
                         _x(entry["save_iterations_warm"]), _s(lost), *ratios,
                         _s(entry["first_and_setup_s"]), _s(entry["setup_s"]),
                         _s(entry.get("background_cpu_warm_s")), _s(entry.get("finalize_warm_s")),
                         _s(entry.get("build_and_warmup_s"))])
        parts += [f"#### {ranks} rank(s), GPT {num_layers} layers x {hidden}: {size} per rank, "
                  f"free iteration {_s(free)}, one memory copy of the state {_s(memcpy)}", "",
                  _table(header, rows), ""]
    return "\n".join(parts)


def format_lost_time_targets(rows: List[Dict[str, Any]]) -> str:
    """Measured ratio and verdict of every lost-time target (never asserted)."""
    table = [[LOST_TIME_TARGETS[r["target"]], r["method"], str(r["ranks"]), str(r["hidden_size"]),
              f"{_x(r['ratio'])} {r['verdict']}"] for r in rows]
    return _table(["target", "method", "ranks", "hidden", "measured ratio"], table)


def draw_lost_time_plot(entries: List[Dict[str, Any]], out_dir: str) -> List[str]:
    """``lost_time_vs_state_size.png``: lost time per warm save against bytes per rank,
    one panel per rank count. Returns the written paths (none without matplotlib)."""
    import os

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ok = [e for e in entries if _ok(e)]
    rank_counts = sorted({e["ranks"] for e in ok})
    if not rank_counts:
        return []
    fig, axes = plt.subplots(1, len(rank_counts), figsize=(6 * len(rank_counts), 4.5),
                             squeeze=False)
    for ax, ranks in zip(axes[0], rank_counts):
        for method in LOST_TIME_METHODS:
            points = sorted((e["num_bytes_per_rank"] / 2**20, e["lost_warm_s"]) for e in ok
                            if e["ranks"] == ranks and e["method"] == method)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        ax.set_xlabel("state per rank (MiB)")
        ax.set_ylabel("lost time per warm save (s)")
        ax.set_title(f"{ranks} rank(s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "lost_time_vs_state_size.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
