"""The scale benchmark's report: the markdown table of its measurements, and its plot.

One row per :class:`~tools.bench.scale.ScaleResult` (layout, ranks x items, method), then
ours against DCP per (layout, size); the plot draws the first save's plan + commit time
against the item count. Runs in the launching process (``tools/benchmark.py --scale``),
after the measurements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Sequence

if TYPE_CHECKING:
    from .scale import ScaleResult

__all__ = ["format_row", "render", "plot"]

_HEADER = ("| layout | ranks x items | method | plan (first save) | commit | gathered | "
           "`.metadata` | peak RSS plan / commit |\n| --- | --- | --- | --- | --- | --- | --- | --- |")


def format_row(r: ScaleResult) -> str:
    """One measurement as a row of the table."""
    commit = f"{r.commit_s:.3f} s" if r.method != "mcore_planner" else "-"
    if r.warm_cpu_s >= 0:
        commit += f" (checks + splice {r.warm_cpu_s * 1000:.1f} ms)"
    size = f"{r.metadata_bytes / 2**20:.1f} MiB" if r.metadata_bytes else "-"
    rank_side = f" (+{r.rank_side_s * 1e3:.2f} ms per rank)" if r.rank_side_s else ""
    plan = "-" if r.method == "ours_warm" else f"{r.plan_s:.3f} s"
    gathered = "-" if r.gathered_bytes < 0 else f"{r.gathered_bytes / 2**20:.1f} MiB"
    return (f"| {r.layout} | {r.ranks} x {r.items_per_rank} ({r.items:,}) | {r.method} | "
            f"{plan}{rank_side} | {commit} | {gathered} | {size} | "
            f"{r.plan_peak_mib:.0f} / {r.commit_peak_mib:.0f} MiB |")


def render(results: Sequence[ScaleResult]) -> str:
    """The markdown table, with ours against DCP per row group."""
    lines = [_HEADER, *(format_row(r) for r in results)]
    by_key: Dict[Any, Dict[str, ScaleResult]] = {}
    for r in results:
        by_key.setdefault((r.layout, r.ranks, r.items_per_rank), {})[r.method] = r
    ratios = []
    for (layout, n, items), group in by_key.items():
        if "ours" in group and "dcp" in group:
            ours, dcp = group["ours"], group["dcp"]
            ratios.append(
                f"| {layout} | {n} x {items} | {ours.plan_s / max(dcp.plan_s, 1e-9):.2f} | "
                f"{ours.commit_s / max(dcp.commit_s, 1e-9):.2f} | "
                f"{(ours.plan_s + ours.commit_s) / max(dcp.plan_s + dcp.commit_s, 1e-9):.2f} | "
                f"{ours.metadata_bytes / max(dcp.metadata_bytes, 1):.2f} |"
            )
    if ratios:
        lines += ["", "| layout | ranks x items | plan, ours / DCP | commit, ours / DCP | "
                  "plan + commit, ours / DCP | `.metadata`, ours / DCP |",
                  "| --- | --- | --- | --- | --- | --- |", *ratios]
    return "\n".join(lines)


def plot(results: Sequence[ScaleResult], path: str) -> bool:
    """Plan + commit time against the item count, one line per (layout, method)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series: Dict[Any, List[ScaleResult]] = {}
    for r in results:
        if r.method not in ("mcore_planner", "ours_warm"):
            series.setdefault((r.layout, r.method), []).append(r)
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (layout, method), rows in sorted(series.items()):
        rows.sort(key=lambda r: r.items)
        ax.plot([r.items for r in rows], [r.plan_s + r.commit_s for r in rows], marker="o",
                label=f"{method}, {layout}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("items in the checkpoint (ranks x items per rank)")
    ax.set_ylabel("coordinator: plan + commit (s)")
    ax.set_title("First save's coordinator work against job size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
