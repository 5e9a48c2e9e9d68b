"""The stall benchmark's plots: stall and planning against the tensor count and the ranks.

Launching side, at the end of a run (or of a ``--from-results`` redo): two small PNGs
in ``--out``, ``stall_vs_tensor_count.png`` and ``stall_vs_ranks.png``, each with the
training stall per save (left) and the planning call (right), warm saves solid and the
first save dotted, one colour per method.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List

from .config import ALL_VARIANTS, CHECKSUM_VARIANTS, format_num_bytes
from .results import staging_limit

__all__ = ["draw_plots"]


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
