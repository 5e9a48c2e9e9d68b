"""How a save's coordinator cost grows with the job: thousands of ranks, by simulation.

Runs in one process per measurement, no distributed job: it synthesizes the local plans
and the write results of N ranks (the shapes megatron-core's layouts produce) and runs
the *real* coordinator code on them, the code the coordinator rank runs on the training
thread while every other rank waits:

* ``plan``: global planning and validation of a first save (``build_global_metadata``
  with megatron-core's ``MCoreSavePlanner``, which our strategy uses);
* ``commit``: what a save's finalize does on the coordinator once the write results
  are gathered (``commit_checkpoint``: storage data, ``.metadata``), into a temporary
  directory: the first save, and any save whose structure changed;
* ``ours_warm``: the finalization of a warm save (cached plans, unchanged structure),
  which gathers nothing and writes ``.metadata`` from the previous commit's bytes
  (:mod:`tools.bench.scale_warm`); its ``commit`` column is that whole finalization on
  the coordinator, and the ``gathered`` column shows what each path ships to it.

The anchors run the same plans through PyTorch DCP's ``DefaultSavePlanner`` (global plan)
and DCP's own commit (storage data on the metadata, one pickle), and through
megatron-core's planner alone. Each (method, N) runs in a fresh child process, so the
peak resident memory it reports (``ru_maxrss`` after minus before the phase) belongs to
that phase alone.

Layouts (``--layouts``):

* ``tp8``: every tensor split along its first axis over a tensor-parallel group of 8;
* ``dist_optimizer``: the distributed optimizer's fully reshardable state, every tensor
  flattened and split over all N ranks;
* ``moe``: experts, each rank owning whole tensors of its own.

Run it as ``python tools/benchmark.py --scale --ranks 64,256,1024 --items-per-rank 100,300``
(or ``python -m tools.bench.scale ...``); ``--sizes 1024x300,4096x250`` measures given
``ranks x items per rank`` pairs instead of every combination.

The simulation times no collective, but the ``ours`` and ``dcp`` rows measure what each
gather ships (bytes) and the coordinator's unpickling of it at full size.
``--scale --calibrate`` times the gathers on real gloo ranks
(:mod:`tools.bench.gather_calibration`), and ``--calibration FILE`` adds the estimated
gathers to the report: plan, gathers and commit per save, ours against DCP.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import pickle
import resource
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Sequence

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

__all__ = ["LAYOUTS", "METHODS", "ScaleResult", "shard_write_item", "synthesize_rank",
           "synthesize", "measure",
           "run_sweep", "main"]

LAYOUTS = ("tp8", "dist_optimizer", "moe")
METHODS = ("ours", "ours_warm", "dcp", "mcore_planner")
"""``ours``: build_global_metadata + commit_checkpoint; ``ours_warm``: a warm save's
finalization (no planning, nothing gathered); ``dcp``: DefaultSavePlanner + DCP's commit;
``mcore_planner``: megatron-core's planner's global plan alone."""

_ROWS_PER_CHUNK = 64
_COLUMNS = 128
_ITEM_BYTES = _ROWS_PER_CHUNK * _COLUMNS * 2  # bf16


@dataclasses.dataclass
class ScaleResult:
    """One measurement: a method on the plans of ``ranks`` x ``items_per_rank``."""

    method: str
    layout: str
    ranks: int
    items_per_rank: int
    plan_s: float
    commit_s: float
    metadata_bytes: int
    plan_peak_mib: float
    commit_peak_mib: float
    gathered_bytes: int = -1
    """What the coordinator receives at finalize (write results); -1: not measured."""
    warm_cpu_s: float = -1.0
    """``ours_warm``: of ``commit_s``, the checks of the coordinator's own items and the
    splice of ``.metadata`` (the rest is the durable write of its bytes); -1 elsewhere."""
    rank_side_s: float = 0.0
    """``ours``: what one rank spends beside its local plan (its plan's digest), in parallel."""
    plan_gathered_bytes: int = -1
    """What the coordinator receives at planning (local plans); -1: not measured."""
    gathers: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)
    """``ours``/``dcp``: per gather, its bytes and the coordinator's unpickling of them."""

    @property
    def items(self) -> int:
        return self.ranks * self.items_per_rank


def shard_write_item(fqn: str, offsets: Sequence[int], sizes: Sequence[int],
                     whole: Sequence[int]) -> WriteItem:
    """One shard's write item, as DCP's planner makes it (a new ``torch.Size`` per value)."""
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=torch.bfloat16),
            size=torch.Size(whole),
        ),
    )


def _rank_items(layout: str, rank: int, ranks: int, items_per_rank: int) -> List[WriteItem]:
    """The write items of one rank under ``layout`` (deterministic)."""
    items = []
    if layout == "tp8":
        group, tp_rank = divmod(rank, 8)
        tp_size = min(8, ranks - group * 8)
        for j in range(items_per_rank):
            whole = (_ROWS_PER_CHUNK * tp_size, _COLUMNS)
            items.append(shard_write_item(f"stage{group}.layer{j}.weight",
                                          (tp_rank * _ROWS_PER_CHUNK, 0),
                                          (_ROWS_PER_CHUNK, _COLUMNS), whole))
    elif layout == "dist_optimizer":
        numel = _ROWS_PER_CHUNK * _COLUMNS
        for j in range(items_per_rank):
            items.append(shard_write_item(f"optimizer.state.{j}.exp_avg", (rank * numel,),
                                          (numel,), (ranks * numel,)))
    elif layout == "moe":
        for j in range(items_per_rank):
            shape = (_ROWS_PER_CHUNK, _COLUMNS)
            items.append(shard_write_item(f"experts.{rank}.linear{j}.weight", (0, 0), shape, shape))
    else:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    return items


def synthesize_rank(layout: str, rank: int, ranks: int, items_per_rank: int,
                    shared_sizes: bool = True):
    """The local plan and the write results of one rank, as it ships them to the coordinator.

    ``shared_sizes``: one ``torch.Size`` object per distinct value, as our ranks make their
    plans (:func:`megatron_async.saver.global_metadata.share_equal_sizes`); False for DCP's and megatron-core's
    own ranks, whose planners make a new one per value.
    """
    from megatron_async.saver.global_metadata import share_equal_sizes
    from megatron_async.writer.bucket_io import ChecksummedWriteResult

    plan = SavePlan(_rank_items(layout, rank, ranks, items_per_rank))
    items = (share_equal_sizes(plan) if shared_sizes else plan).items  # results share indexes
    file_name = f"__{rank}_0.distcp"
    results = [
        ChecksummedWriteResult(
            item.index, _ITEM_BYTES,
            _StorageInfo(file_name, position * _ITEM_BYTES, _ITEM_BYTES),
            f"{(rank * 1_000_003 + position) & 0xFFFFFFFFFFFFFFFF:016x}",
        )
        for position, item in enumerate(items)
    ]
    return SavePlan(items), results


def synthesize(layout: str, ranks: int, items_per_rank: int, shared_sizes: bool = True):
    """Local plans and write results of every rank, as the coordinator receives them.

    Each rank's plan and results go through pickle as a gather sends them: objects a rank
    shares stay shared within its own, and no object is shared between ranks.
    """
    plans, results = [], []
    for rank in range(ranks):
        plan, rank_results = synthesize_rank(layout, rank, ranks, items_per_rank, shared_sizes)
        plans.append(pickle.loads(pickle.dumps(plan)))
        results.append(pickle.loads(pickle.dumps(rank_results)))
    return plans, results


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _mcore_planner():
    """The planner our strategy saves with (its default options)."""
    from megatron_async.mcore import generation
    from megatron_async.mcore.config import TorchDistSaveConfig

    return generation.create_save_planner(TorchDistSaveConfig())


def _plan(method: str, plans, digests=None):
    if method == "ours":
        from megatron_async.saver.global_metadata import build_global_metadata

        return build_global_metadata(_mcore_planner(), plans, digests)
    planner = DefaultSavePlanner(flatten_state_dict=False) if method == "dcp" else _mcore_planner()
    _, metadata = planner.create_global_plan(plans)
    return metadata


def _commit(method: str, metadata, results, directory: str) -> int:
    """The coordinator's commit of one save; returns the ``.metadata`` bytes."""
    if method == "ours":
        from megatron_async.writer.commit import commit_checkpoint

        commit_checkpoint(directory, metadata, results, None)
        return os.path.getsize(os.path.join(directory, ".metadata"))
    # DCP's FileSystemWriter.finish: storage data from the results, one pickle.
    metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
    data = pickle.dumps(metadata)
    with open(os.path.join(directory, ".metadata"), "wb") as stream:
        stream.write(data)
        os.fsync(stream.fileno())
    return len(data)


def _measure_in_child(method: str, layout: str, ranks: int, items_per_rank: int, conn) -> None:
    """Child process: synthesize, then time one method's phases and their peak memory."""
    plans, results = synthesize(layout, ranks, items_per_rank,
                                shared_sizes=method in ("ours", "ours_warm"))
    directory = tempfile.mkdtemp(prefix="scale-bench-")
    try:
        if method == "ours_warm":
            conn.send(_measure_warm(layout, ranks, items_per_rank, plans, results, directory))
            return
        digests, rank_side_s = None, 0.0
        if method == "ours":  # every rank digests its own plan and sends it with the plan
            from megatron_async.saver.metadata_cache import plan_digest

            start = time.perf_counter()
            digests = [plan_digest(plan) for plan in plans]
            rank_side_s = (time.perf_counter() - start) / ranks
        before = _peak_mib()
        start = time.perf_counter()
        metadata = _plan(method, plans, digests)
        plan_s = time.perf_counter() - start
        after_plan = _peak_mib()
        commit_s, metadata_bytes = 0.0, 0
        if method != "mcore_planner":
            start = time.perf_counter()
            metadata_bytes = _commit(method, metadata, results, directory)
            commit_s = time.perf_counter() - start
        commit_peak = _peak_mib() - after_plan
        from .gather_model import measure_gathers  # after the peaks: it holds every pickle

        gathers = measure_gathers(method, plans, results) if method != "mcore_planner" else {}
        num_bytes = {gather: g["num_bytes"] for gather, g in gathers.items()}
        conn.send(ScaleResult(method, layout, ranks, items_per_rank, plan_s, commit_s,
                              metadata_bytes, after_plan - before, commit_peak,
                              num_bytes.get("result_gather", -1), rank_side_s=rank_side_s,
                              plan_gathered_bytes=num_bytes.get("plan_gather", -1),
                              gathers=gathers))
    except BaseException as exc:  # reported to the parent, which raises it
        conn.send(exc)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        conn.close()


def _measure_warm(layout, ranks, items_per_rank, plans, results, directory) -> ScaleResult:
    """A warm save's finalization on the coordinator (planning and the first save untimed)."""
    from .scale_warm import measure_warm_finalize

    metadata = _plan("ours", plans)
    before = _peak_mib()
    warm = measure_warm_finalize(metadata, results, directory)
    return ScaleResult("ours_warm", layout, ranks, items_per_rank, 0.0, warm["warm_s"],
                       warm["metadata_bytes"], 0.0, _peak_mib() - before, 0, warm["cpu_s"])


def measure(method: str, layout: str, ranks: int, items_per_rank: int, timeout_s: float = 1800.0) -> ScaleResult:
    """One measurement in a fresh spawned process (bounded by ``timeout_s``)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_measure_in_child, args=(method, layout, ranks, items_per_rank, child))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"{method} at {ranks} ranks x {items_per_rank} items took over {timeout_s:.0f}s")
        outcome = parent.recv()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def run_sweep(ranks: Sequence[int], items_per_rank: Sequence[int], layouts: Sequence[str],
              methods: Sequence[str] = METHODS, sizes: Sequence[Any] = ()) -> List[ScaleResult]:
    """Every (layout, N, items per rank, method), smallest first (or the given ``sizes``)."""
    pairs = list(sizes) or [(n, items) for items in items_per_rank for n in sorted(ranks)]
    results = []
    for layout in layouts:
        for n, items in pairs:
            for method in methods:
                result = measure(method, layout, n, items)
                print(_format_row(result), flush=True)
                results.append(result)
    return results


_HEADER = ("| layout | ranks x items | method | plan (first save) | commit | gathered | "
           "`.metadata` | peak RSS plan / commit |\n| --- | --- | --- | --- | --- | --- | --- | --- |")


def _format_row(r: ScaleResult) -> str:
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
    lines = [_HEADER, *(_format_row(r) for r in results)]
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


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x]


def _sizes(text: str) -> List[Any]:
    return [tuple(int(x) for x in pair.split("x")) for pair in text.split(",") if pair]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=_ints, default=_ints("64,256,1024"))
    parser.add_argument("--items-per-rank", type=_ints, default=_ints("100,300"))
    parser.add_argument("--layouts", type=lambda t: t.split(","), default=list(LAYOUTS))
    parser.add_argument("--methods", type=lambda t: t.split(","), default=list(METHODS))
    parser.add_argument("--sizes", type=_sizes, default=[],
                        help="ranks x items pairs, e.g. 1024x300,4096x250 (instead of the grid)")
    parser.add_argument("--out", default="bench_scale")
    parser.add_argument("--calibration", metavar="JSON", help="gather_calibration.json "
                        "(from --calibrate): adds the estimated gathers per save")
    parser.add_argument("--calibrate", action="store_true", help="calibrate the gathers "
                        "instead (the options are then tools.bench.gather_calibration's)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--calibrate" in argv:
        from .gather_calibration import main as calibrate

        calibrate([a for a in argv if a != "--calibrate"])
        return
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = run_sweep(args.ranks, args.items_per_rank, args.layouts, args.methods, args.sizes)
    table = render(results)
    if args.calibration:
        from .gather_model import render_scale_estimates

        with open(args.calibration) as stream:
            table += "\n\n" + render_scale_estimates(results, json.load(stream))
    with open(os.path.join(args.out, "scale.md"), "w") as stream:
        stream.write(table + "\n")
    with open(os.path.join(args.out, "scale.json"), "w") as stream:
        json.dump([dataclasses.asdict(r) for r in results], stream, indent=1)
    plotted = plot(results, os.path.join(args.out, "scale.png"))
    print(table)
    print(f"wrote {args.out}/scale.md, scale.json" + (", scale.png" if plotted else ""))


if __name__ == "__main__":
    main()
