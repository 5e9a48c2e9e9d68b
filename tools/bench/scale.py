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

This module measures and holds the command line; the synthesized plans come from
:mod:`tools.bench.scale_plans`, the table and plot from :mod:`tools.bench.scale_report`.
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

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .scale_plans import LAYOUTS, synthesize
from .scale_report import format_row, plot, render

__all__ = ["METHODS", "ScaleResult", "measure", "run_sweep", "main"]

METHODS = ("ours", "ours_warm", "dcp", "mcore_planner")
"""``ours``: build_global_metadata + commit_checkpoint; ``ours_warm``: a warm save's
finalization (no planning, nothing gathered); ``dcp``: DefaultSavePlanner + DCP's commit;
``mcore_planner``: megatron-core's planner's global plan alone."""


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
                print(format_row(result), flush=True)
                results.append(result)
    return results


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
