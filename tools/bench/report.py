"""Turn per-rank results into per-save numbers, the targets, a table and plots.

Across ranks, a save is as slow as its slowest rank: stalls, planning and finalize are
the maximum over ranks; the write span runs from the first rank's write start to the last
rank's write end, and throughputs divide every rank's bytes by it. Warm numbers are the
median of the saves after the first (the machine may be shared; a median shrugs off one
disturbed save), with the maximum kept in the JSON.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence

from .config import ALL_VARIANTS, CHECKSUM_VARIANTS, format_num_bytes

__all__ = [
    "aggregate_run",
    "evaluate_targets",
    "combine_limits",
    "format_limits",
    "format_run_table",
    "format_targets",
    "format_checksums",
    "format_scaling",
    "draw_plots",
    "TARGETS",
]

_GROWTH_TOLERANCE_FRACTION = 0.02
_GROWTH_TOLERANCE_MIN_BYTES = 4 * 2**20

TARGETS = {
    "stall_vs_memcpy": "warm stall <= 1.2 x (bytes per rank / memcpy bandwidth)",
    "write_vs_disk": "background write throughput >= 0.8 x disk bandwidth",
    "stall_vs_dcp_async": "warm stall <= 0.5 x DCP async_save warm stall",
    "plan_cached_vs_first": "warm planning (cached structure) <= 10% of the first save's",
    "memory_growth": "no host memory growth from save 2 to the last (<= 2% of bytes per rank, "
                     ">= 4 MiB)",
    "staging_held": "staging memory held between saves <= 1.1 x bytes per rank",
}


def _max(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _aggregate_save(records: Sequence[Dict[str, Any]], ranks: Sequence[Dict[str, Any]]):
    total_bytes = sum(r["num_bytes"] for r in ranks)
    starts = [s.get("write_start") for s in records]
    ends = [s.get("write_end") for s in records]
    write_span = None
    if all(v is not None for v in starts + ends):
        write_span = max(ends) - min(starts)
    e2e = _max([s["e2e_s"] for s in records])
    return {
        "build_s": _max([s["build_s"] for s in records]),
        "plan_s": _max([s["plan_s"] for s in records]),
        "strategy_plan_s": _max([s["strategy_plan_s"] for s in records]),
        "stage_s": _max([s["stage_s"] for s in records]),
        "stall_s": _max([s["stall_s"] for s in records]),
        "train_step_s": _max([s["train_step_s"] for s in records]),
        "write_s": write_span,
        "write_bytes_per_s": total_bytes / write_span if write_span else None,
        "finalize_s": _max([s["finalize_s"] for s in records]),
        "e2e_s": e2e,
        "e2e_bytes_per_s": total_bytes / e2e if e2e else None,
        "peak_rss": _max([s["peak_rss"] for s in records]),
        "peak_rss_extra": _max([s["peak_rss"] - r["rss_base"] for s, r in zip(records, ranks)]),
        "peak_worker_rss": _max([s["peak_worker_rss"] for s in records]),
        "held_total": _max([s["pss_after"] - r["pss_base"] for s, r in zip(records, ranks)]),
        "held_staging": _max([s["pss_after"] - r["pss_idle"] for s, r in zip(records, ranks)]),
        # The same, split: what the rank holds, and what its background processes hold.
        "held_staging_rank": _max([s["pss_rank"] - r["pss_idle_rank"]
                                   for s, r in zip(records, ranks)]),
        "held_staging_background": _max([s["pss_background"] - r["pss_idle_background"]
                                         for s, r in zip(records, ranks)]),
        "dir_bytes": records[0].get("dir_bytes"),
        "reused_plans": all(s.get("reused_plans") for s in records),
    }


def _summary(saves: Sequence[Dict[str, Any]], reducer) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key in saves[0]:
        values = [s[key] for s in saves if isinstance(s[key], (int, float)) and s[key] is not None]
        if values and not isinstance(saves[0][key], bool):
            out[key] = reducer(values)
    return out


def aggregate_run(meta: Dict[str, Any], ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Combine one launch's per-rank results into one run entry of results.json."""
    run = dict(meta)
    run["status"] = ranks[0]["status"]
    run["reason"] = ranks[0]["reason"]
    run["notes"] = sorted({n for r in ranks for n in r.get("notes", [])})
    run["num_bytes_per_rank"] = [r["num_bytes"] for r in ranks]
    run["tensor_count_per_rank"] = [r["tensor_count"] for r in ranks]
    run["per_rank"] = ranks
    if run["status"] != "ok" or not ranks[0]["saves"]:
        return run
    count = min(len(r["saves"]) for r in ranks)
    saves = [_aggregate_save([r["saves"][i] for r in ranks], ranks) for i in range(count)]
    run["saves"] = saves
    run["first"] = saves[0]
    run["warm"] = _summary(saves[1:], statistics.median)
    run["warm_max"] = _summary(saves[1:], max)
    return run


def _find(runs, **match) -> Optional[Dict[str, Any]]:
    for run in runs:
        if all(run.get(k) == v for k, v in match.items()) and run.get("status") == "ok":
            return run
    return None


def _target(name: str, measured: Optional[float], limit: float, higher_is_better: bool,
            detail: str) -> Dict[str, Any]:
    if measured is None:
        return {"target": name, "ratio": None, "limit": limit, "verdict": "N/A", "detail": detail}
    ok = measured >= limit if higher_is_better else measured <= limit
    return {"target": name, "ratio": measured, "limit": limit,
            "verdict": "PASS" if ok else "MISS", "detail": detail}


def staging_limit(limits: Dict[str, float]) -> float:
    """Bandwidth that bounds staging: device-to-host with CUDA, else host memory copy."""
    return limits.get("d2h_concurrent_bytes_per_s") or limits["memcpy_concurrent_bytes_per_s"]


def evaluate_targets(runs: List[Dict[str, Any]], limits: Dict[str, float], ranks: int,
                     our_variants: Sequence[str]) -> List[Dict[str, Any]]:
    """Evaluate every target for each of our callers and synthetic tensor count."""
    memcpy = staging_limit(limits)
    disk = max(limits["disk_single_bytes_per_s"], limits["disk_concurrent_bytes_per_s"])
    rows = []
    counts = sorted({r["tensor_count"] for r in runs if r["workload"] == "synthetic"
                     and r["ranks"] == ranks and r["sweep"] == "main"})
    for variant in our_variants:
        for count in counts:
            run = _find(runs, workload="synthetic", tensor_count=count, ranks=ranks,
                        variant=variant, sweep="main")
            if run is None:
                continue
            dcp = _find(runs, workload="synthetic", tensor_count=count, ranks=ranks,
                        variant="dcp_async_thread", sweep="main")
            warm, first, saves = run["warm"], run["first"], run["saves"]
            bytes_per_rank = max(run["num_bytes_per_rank"])
            copy_s = bytes_per_rank / memcpy
            results = [
                _target("stall_vs_memcpy", warm["stall_s"] / copy_s, 1.2, False,
                        f"warm stall {warm['stall_s'] * 1e3:.0f} ms vs copy {copy_s * 1e3:.0f} ms"),
                _target("write_vs_disk", (warm.get("write_bytes_per_s") or 0) / disk, 0.8, True,
                        f"{(warm.get('write_bytes_per_s') or 0) / 1e9:.2f} GB/s vs "
                        f"{disk / 1e9:.2f} GB/s"),
                _target("stall_vs_dcp_async",
                        warm["stall_s"] / dcp["warm"]["stall_s"] if dcp else None, 0.5, False,
                        f"vs dcp_async_thread {dcp['warm']['stall_s'] * 1e3:.0f} ms"
                        if dcp else "dcp_async_thread not run"),
                _target("plan_cached_vs_first", warm["plan_s"] / first["plan_s"], 0.10, False,
                        f"warm {warm['plan_s'] * 1e3:.0f} ms vs first "
                        f"{first['plan_s'] * 1e3:.0f} ms"),
            ]
            held = [s["held_total"] for s in saves]
            if len(held) >= 2:
                # The first save allocates what every later save reuses (buffers, caches):
                # growth is counted from the first warm save when there is one.
                reference = 1 if len(held) >= 3 else 0
                growth = held[-1] - held[reference]
                tolerance = max(_GROWTH_TOLERANCE_FRACTION * bytes_per_rank,
                                _GROWTH_TOLERANCE_MIN_BYTES)
                results.append(_target(
                    "memory_growth", growth / bytes_per_rank, tolerance / bytes_per_rank, False,
                    f"held after save {len(held)} minus after save {reference + 1}: "
                    f"{format_num_bytes(growth)}",
                ))
            staging = max(s["held_staging"] for s in saves[1:])
            results.append(_target(
                "staging_held", staging / bytes_per_rank, 1.1, False,
                f"max {format_num_bytes(staging)} held (PSS, rank + background process)",
            ))
            for row in results:
                row.update(variant=variant, tensor_count=count)
                rows.append(row)
    return rows


def _fmt_s(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.0f}ms" if value < 10 else f"{value:.1f}s"


def _fmt_rate(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _fmt_mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _markdown(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def combine_limits(measurements: List[Dict[str, float]]) -> Dict[str, float]:
    """The best of several limit measurements: a limit is what the hardware can do, and a
    shared disk or CPU only ever makes a single measurement lower."""
    combined = dict(measurements[0])
    for other in measurements[1:]:
        for key, value in other.items():
            if key.endswith("_bytes_per_s"):
                combined[key] = max(combined.get(key, 0.0), value)
    return combined


def format_limits(measurements: List[Dict[str, float]]) -> str:
    """The physical limits as a markdown table: each measurement and the one used (best)."""
    used = combine_limits(measurements)
    writers = int(used["disk_concurrent_writers"])
    rows = [
        ("memory copy, 1 process", "memcpy_single_bytes_per_s"),
        (f"memory copy, per rank, {writers} ranks at once", "memcpy_concurrent_bytes_per_s"),
        ("device to pinned host, per rank, all ranks at once", "d2h_concurrent_bytes_per_s"),
        ("write + fsync, 1 writer", "disk_single_bytes_per_s"),
        (f"write + fsync, {writers} writers (aggregate)", "disk_concurrent_bytes_per_s"),
    ]
    header = ["physical limit (GB/s)"] + (
        ["at start", "at end", "used (best)"] if len(measurements) > 1 else ["measured"]
    )
    body = []
    for label, key in rows:
        if key not in used:
            continue
        values = [_fmt_rate(m.get(key)) for m in measurements]
        body.append([label] + values + ([_fmt_rate(used[key])] if len(measurements) > 1 else []))
    return _markdown(header, body)


_RUN_HEADER = [
    "method", "stall 1st", "stall warm", "plan 1st", "plan warm", "write warm", "write GB/s",
    "finalize", "e2e warm", "e2e GB/s", "train step", "peak RSS rank MiB", "peak RSS bg MiB",
    "held MiB", "staging held MiB",
]


def format_run_table(runs: List[Dict[str, Any]]) -> str:
    """One workload's runs (same workload, tensor count, ranks) as a markdown table."""
    rows = []
    for run in runs:
        if run["status"] != "ok":
            rows.append([run["variant"], f"{run['status']}: see notes"]
                        + [""] * (len(_RUN_HEADER) - 2))
            continue
        first, warm = run["first"], run["warm"]
        rows.append([
            run["variant"], _fmt_s(first["stall_s"]), _fmt_s(warm["stall_s"]),
            _fmt_s(first.get("plan_s")), _fmt_s(warm.get("plan_s")), _fmt_s(warm.get("write_s")),
            _fmt_rate(warm.get("write_bytes_per_s")), _fmt_s(warm.get("finalize_s")),
            _fmt_s(warm["e2e_s"]), _fmt_rate(warm.get("e2e_bytes_per_s")),
            _fmt_s(warm.get("train_step_s")), _fmt_mib(warm.get("peak_rss")),
            _fmt_mib(warm.get("peak_worker_rss")), _fmt_mib(warm.get("held_total")),
            _fmt_mib(warm.get("held_staging")),
        ])
    return _markdown(_RUN_HEADER, rows)


def format_targets(rows: List[Dict[str, Any]]) -> str:
    """The targets as a markdown table: one row per target, one column per caller and tensor
    count, each cell ``measured ratio VERDICT``."""
    columns: List[tuple] = []
    cells: Dict[tuple, str] = {}
    for row in rows:
        column = (row["variant"], row["tensor_count"])
        if column not in columns:
            columns.append(column)
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3g}"
        cells[(row["target"], column)] = f"{ratio} {row['verdict']}"
    body = []
    for name, text in TARGETS.items():
        if any((name, column) in cells for column in columns):
            body.append([text] + [cells.get((name, column), "-") for column in columns])
    header = ["target (measured ratio)"] + [f"{v} {c}t" for v, c in columns]
    return _markdown(header, body)


def format_checksums(runs: List[Dict[str, Any]], variant: str, default_on: bool) -> str:
    """Our persistent caller with and without checksums, side by side."""
    body = []
    for run in runs:
        if run["variant"] != variant or run["sweep"] != "main" or run["status"] != "ok":
            continue
        base = _find(runs, workload=run["workload"], tensor_count=run["tensor_count"],
                     ranks=run["ranks"], variant="ours_persistent", sweep="main")
        if base is None:
            continue
        on, off = (base, run) if default_on else (run, base)
        label = (f"synthetic {run['tensor_count']}t" if run["workload"] == "synthetic"
                 else run["workload"])
        body.append([label, _fmt_rate(on["warm"].get("write_bytes_per_s")),
                     _fmt_rate(off["warm"].get("write_bytes_per_s")),
                     _fmt_s(on["warm"].get("write_s")), _fmt_s(off["warm"].get("write_s")),
                     _fmt_s(on["warm"].get("finalize_s")), _fmt_s(off["warm"].get("finalize_s"))])
    return _markdown(["workload", "write GB/s with", "without", "write with", "without",
                      "finalize with", "without"], body)


def format_scaling(runs: List[Dict[str, Any]]) -> str:
    """Stall and planning against the rank count, as a markdown table."""
    body = []
    for run in sorted(runs, key=lambda r: (r["variant"], r["ranks"])):
        if run["status"] != "ok":
            continue
        body.append([run["variant"], str(run["ranks"]), _fmt_s(run["first"]["stall_s"]),
                     _fmt_s(run["warm"]["stall_s"]), _fmt_s(run["first"].get("plan_s")),
                     _fmt_s(run["warm"].get("plan_s"))])
    return _markdown(["method", "ranks", "stall 1st", "stall warm", "plan 1st", "plan warm"], body)


def _color(variant: str) -> str:
    """One colour per method, the same in every plot."""
    names = list(ALL_VARIANTS) + list(CHECKSUM_VARIANTS)
    return f"C{names.index(variant) % 10}" if variant in names else "k"


def _plot_first_and_warm(ax, xs, runs, key: str, variant: str, with_first: bool = True):
    """Draw ``key`` of the warm saves (solid) and of the first save (dotted) against ``xs``."""
    ours = variant.startswith("ours")
    warm = ax.plot(xs, [r["warm"][key] for r in runs], marker="o", color=_color(variant),
                   linewidth=2.2 if ours else 1.2, label=f"{variant} (warm)")[0]
    if with_first:
        ax.plot(xs, [r["first"][key] for r in runs], marker="x", linestyle=":",
                color=warm.get_color(), label=f"{variant} (1st)")
    return warm.get_color()


def _label_twos_and_fives(value: float, _pos) -> str:
    """Minor tick label on a log axis: only 2x and 5x a power of ten."""
    if value <= 0:
        return ""
    leading = round(value / 10 ** math.floor(math.log10(value)))
    return f"{value:g}" if leading in (2, 5) else ""


def _style_axes(ax, xlabel: str, title: str, log_x: bool) -> None:
    from matplotlib.ticker import FuncFormatter

    if log_x:
        ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds")
    ax.set_title(title, fontsize=9)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(_label_twos_and_fives))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left")


def draw_plots(runs: List[Dict[str, Any]], limits: Dict[str, float], main_ranks: int,
               out_dir: str) -> List[str]:
    """Draw the scaling plots (PNG, small); return their paths."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    synthetic = [r for r in runs if r["workload"] == "synthetic" and r["ranks"] == main_ranks
                 and r["sweep"] == "main" and r["status"] == "ok"]
    scaling = [r for r in runs if r["sweep"] == "ranks" and r["status"] == "ok"]
    for name, group, x_key, xlabel in (
        ("stall_vs_tensor_count.png", synthetic, "tensor_count", "tensors per rank"),
        ("stall_vs_ranks.png", scaling, "ranks", "ranks"),
    ):
        if not group:
            continue
        fig, (ax_stall, ax_plan) = plt.subplots(1, 2, figsize=(11, 4.2))
        # The checksum variant is compared in its own table, not here.
        for variant in sorted({r["variant"] for r in group if "checksums" not in r["variant"]}):
            points = sorted(((r[x_key], r) for r in group if r["variant"] == variant),
                            key=lambda p: p[0])
            xs, chosen = [x for x, _ in points], [r for _, r in points]
            ours = variant.startswith("ours")
            _plot_first_and_warm(ax_stall, xs, chosen, "stall_s", variant, with_first=ours)
            if ours:
                _plot_first_and_warm(ax_plan, xs, chosen, "plan_s", variant)
        sample = group[0]
        bytes_per_rank = max(sample["num_bytes_per_rank"])
        if x_key == "tensor_count":
            ax_stall.axhline(bytes_per_rank / staging_limit(limits),
                             color="k", linestyle="--", linewidth=1, label="memcpy of bytes/rank")
            setting = f"{main_ranks} ranks"
        else:
            setting = f"{sample['tensor_count']} tensors/rank"
        setting += f", {format_num_bytes(bytes_per_rank)}/rank"
        _style_axes(ax_stall, xlabel, f"training stall per save, {setting}",
                    x_key == "tensor_count")
        _style_axes(ax_plan, xlabel, f"planning (dist_checkpointing.save call), {setting}",
                    x_key == "tensor_count")
        if x_key == "ranks":
            for ax in (ax_stall, ax_plan):
                ax.set_xticks(sorted({r["ranks"] for r in group}))
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths
