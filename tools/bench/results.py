"""The stall benchmark's numbers: runs aggregated over ranks, the limits, the targets.

Launching side (``tools/benchmark.py``'s process), after each launch and at the end; what
it computes is what ``results.json`` holds beside the raw per-rank values.

Across ranks, a save is as slow as its slowest rank: stalls, planning and finalize are
the maximum over ranks; the write span runs from the first rank's write start to the last
rank's write end, and throughputs divide every rank's bytes by it. Warm numbers are the
median of the saves after the first (the machine may be shared; a median shrugs off one
disturbed save), with the maximum kept in the JSON.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence

from .config import format_num_bytes

__all__ = [
    "aggregate_run",
    "combine_limits",
    "evaluate_targets",
    "find_run",
    "staging_limit",
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


def find_run(runs, **match) -> Optional[Dict[str, Any]]:
    """The first run that succeeded and matches every ``key=value`` of ``match``."""
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
            run = find_run(runs, workload="synthetic", tensor_count=count, ranks=ranks,
                        variant=variant, sweep="main")
            if run is None:
                continue
            dcp = find_run(runs, workload="synthetic", tensor_count=count, ranks=ranks,
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


def combine_limits(measurements: List[Dict[str, float]]) -> Dict[str, float]:
    """The best of several limit measurements: a limit is what the hardware can do, and a
    shared disk or CPU only ever makes a single measurement lower."""
    combined = dict(measurements[0])
    for other in measurements[1:]:
        for key, value in other.items():
            if key.endswith("_bytes_per_s"):
                combined[key] = max(combined.get(key, 0.0), value)
    return combined
