"""The stall benchmark's report.md: its tables (limits, runs, targets, checksums, scaling)
and the text around them.

Launching side, at the end of a run (or of a ``--from-results`` redo, which must write the
same report.md again): everything here reads ``results.json``'s entries, measures nothing
and writes no file. The numbers come from :mod:`.results`, the plots from
:mod:`.stall_plots`.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from .config import BenchConfig, format_num_bytes
from .results import TARGETS, combine_limits, find_run

__all__ = [
    "format_checksums",
    "format_limits",
    "format_run_table",
    "format_scaling",
    "format_targets",
    "host_lines",
    "render_markdown",
    "run_label",
    "summarize_failure",
]


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
        base = find_run(runs, workload=run["workload"], tensor_count=run["tensor_count"],
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


def host_lines(host: Dict[str, Any]) -> List[str]:
    """The report's first lines: the load average at start and end, the CPUs, the versions."""
    load = {when: ", ".join(f"{v:.2f}" for v in host[f"load_average_{when}"])
            for when in ("start", "end")}
    return [f"Load average (1, 5, 15 min) at start {load['start']}, at end {load['end']}; "
            f"{host['cpu_count']} CPUs; torch {host['torch']}, "
            f"megatron-core {host['megatron_core']}; CUDA: {host['cuda']}.", ""]


def run_label(run: Dict[str, Any]) -> str:
    """Where a run ran: the workload (tensors per rank for the synthetic one) and the ranks."""
    if run["workload"] == "gpt":
        return f"gpt, {run['ranks']} ranks"
    return f"{run['tensor_count']} tensors/rank, {run['ranks']} ranks"


def summarize_failure(reason: str) -> str:
    """The most telling line of a failure: a rank's error, else the last traceback line."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    for line in lines:
        if re.match(r"rank \d+ \[", line):
            return line
    return lines[-1] if lines else ""


def _collect_notes(runs: List[Dict[str, Any]]) -> List[str]:
    """One line per method and distinct note or failure, naming the runs it applies to."""
    seen: Dict[tuple, List[str]] = {}
    runs_of: Dict[str, set] = {}
    for run in runs:
        if run["sweep"] != "main" and run["status"] == "ok":
            continue
        runs_of.setdefault(run["variant"], set()).add(run_label(run))
        texts = ([f"{run['status']}: {summarize_failure(run['reason'])}"]
                 if run["status"] != "ok" else [])
        for text in texts + list(run.get("notes", [])):
            labels = seen.setdefault((run["variant"], text), [])
            if run_label(run) not in labels:
                labels.append(run_label(run))
    lines = []
    for (variant, text), labels in seen.items():
        where = "every run" if set(labels) == runs_of[variant] else "; ".join(labels)
        lines.append(f"- `{variant}` ({where}): {text}")
    return lines


def render_markdown(config: BenchConfig, results: Dict[str, Any]) -> str:
    """report.md: the limits, one table per workload, the targets, checksums, scaling, notes."""
    runs, targets = results["runs"], results["targets"]
    checksums, gpt = results["checksums"], results["gpt"]
    limit_measurements = [results["limits_measured"]["start"], results["limits_measured"]["end"]]
    parts = host_lines(results["host"]) + [
        "### Physical limits", "", format_limits(limit_measurements), ""]
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
                  format_run_table(group), ""]
    parts += ["### Targets (our callers, synthetic workload)", "",
              "Measured ratio and verdict per caller and tensors per rank; the numbers behind "
              "each ratio are in results.json (`targets[].detail`).", "",
              format_targets(targets), ""]
    if checksums["status"] == "measured":
        parts += [f"### Checksums (`{checksums['option']}`, default "
                  f"{'on' if checksums['default'] else 'off'}): ours_persistent, warm saves", "",
                  format_checksums(runs, checksums["variant"], checksums["default"]), ""]
    scaling = [r for r in runs if r["sweep"] == "ranks"]
    if scaling:
        parts += ["### Stall and planning against the rank count", "",
                  format_scaling(scaling), ""]
    notes = _collect_notes(runs)
    if checksums["status"] != "measured":
        notes.append(f"- checksums: {checksums['status']}: {checksums['reason']}")
    notes.append(f"- GPT workload: {gpt['status']}" + (
        f" ({gpt['reason']})" if gpt.get("reason") not in (None, "ok") else ""))
    parts += ["### Notes", ""] + notes + [""]
    return "\n".join(parts)
