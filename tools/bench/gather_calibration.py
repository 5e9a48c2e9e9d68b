"""Calibrate the coordinator's collectives on real gloo ranks: what a gather costs per item.

The scale benchmark (:mod:`tools.bench.scale`) simulates thousands of ranks in one
process, so it times no collective. This tool launches real jobs of a few ranks (2, 4, 8
by default; spawned processes, gloo on loopback), builds on every rank the local plan
and the write results of K items with the scale benchmark's synthesizer
(:mod:`tools.bench.scale_plans`, same layouts), and times the collectives a save's
coordinator pays for, through our code where it exists:

* ``ours_plan_gather``: a first save's gather of every rank's local plan and its digest
  (the saver's ``dist_wrapper.gather_object`` over the coordination group);
* ``ours_result_gather``: a full finalization's gather of the write results;
* ``ours_full_finalize``: the real ``save_state_dict_async_finalize`` with a writer whose
  commit costs nothing, i.e. its two all-reduces and the gather;
* ``warm_allreduces``: a warm finalization's two all-reduces (nothing is gathered);
* ``dcp_plan_gather`` / ``dcp_result_gather``: the same gathers of DCP's own objects
  (its local plan; its write results, without checksums).

Each time is the coordinator's, from a barrier to the collective's return, the median of
``--repeats`` (after one untimed warm-up). Every collective is bounded by
``--collective-timeout-s`` and every launch by ``--launch-timeout-s``. A least-squares fit
``time = a + b * ranks + c * bytes`` per collective (:mod:`tools.bench.gather_model`) is
then extrapolated to the scale benchmark's sizes: an extrapolation from a handful of
ranks on one host, over loopback, so it understates a real network's time.

Run it as ``python -m tools.bench.gather_calibration`` or
``python tools/benchmark.py --scale --calibrate``; then
``python tools/benchmark.py --scale ... --calibration bench_scale/gather_calibration.json``
adds the estimated gathers to the scale report.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time
from typing import Any, Callable, Dict, List, Sequence

from .gather_model import OPS, estimate_s, fit, gathered_objects, modelled_bytes, pickled_bytes
from .launch import RankContext, launch
from .scale import _ints, _sizes
from .scale_plans import LAYOUTS, synthesize_rank

__all__ = ["calibrate", "render", "main"]

_EXTRAPOLATE = "1024x300,4096x250"
"""The scale benchmark's sweep sizes (ranks x items per rank)."""


class _DoneWriter:
    """A rank's writer as finalization sees it after the background write, with a free commit.

    Without a commit cache every finalization takes the full path (the results are
    gathered); ``finish`` does no work, so what is timed is the finalization's collectives.
    """

    def __init__(self, results: List[Any]):
        self.checkpoint_id = self.checkpoint_dir = "gather-calibration"
        self._results = results

    def retrieve_write_results(self) -> List[Any]:
        return self._results

    def finish(self, metadata: Any, results: Any) -> None:
        return None


def _timed(op: Callable[[], Any], repeats: int, group: Any) -> List[float]:
    """Seconds of ``op`` after a barrier, ``repeats`` times after one warm-up (every rank)."""
    from megatron_async.core import coordination

    times = []
    for _ in range(repeats + 1):
        coordination.all_reduce_max([0], group)  # a barrier
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return times[1:]


def _rank_ops(wrapper: Any, ours_synthesized: Any, dcp_synthesized: Any) -> Dict[str, Any]:
    """Every timed collective as ``(call, object shipped or None)`` (every rank).

    Each library's rows get its own rank's ``(plan, results)``: ours with shared sizes,
    DCP's without (:func:`tools.bench.scale_plans.synthesize_rank`)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from megatron_async.core import coordination
    from megatron_async.core.gc_pause import paused_gc
    from megatron_async.integrity.staleness import ChangeReport
    from megatron_async.saver.finalize import save_state_dict_async_finalize

    results = ours_synthesized[1]
    ours = gathered_objects("ours", *ours_synthesized)
    dcp = gathered_objects("dcp", *dcp_synthesized)
    group = wrapper.group

    def gather(shipped: Any, ours: bool) -> Callable[[], Any]:  # each library's call, as it makes it
        if not ours:  # DCP unpickles with the cyclic collector running
            return lambda: wrapper.gather_object(shipped)

        def paused() -> Any:  # ours pauses it around its gathers
            with paused_gc():
                return wrapper.gather_object(shipped)

        return paused

    def warm_allreduces() -> None:  # failed, moved, ranks, stale counts; then the commit's
        failed = coordination.save_failed("gather-calibration")
        coordination.agree(None, failed, [0, 1, *ChangeReport(0, 0, None).counts()], group)
        coordination.agree(None, failed, group=group)

    return {
        "ours_plan_gather": (gather(ours["plan_gather"], True), ours["plan_gather"]),
        "ours_result_gather": (gather(ours["result_gather"], True), ours["result_gather"]),
        "ours_full_finalize": (
            lambda: save_state_dict_async_finalize(_DoneWriter(results), Metadata({}), wrapper),
            ours["result_gather"],
        ),
        "warm_allreduces": (warm_allreduces, None),
        "dcp_plan_gather": (gather(dcp["plan_gather"], False), dcp["plan_gather"]),
        "dcp_result_gather": (gather(dcp["result_gather"], False), dcp["result_gather"]),
    }


def _calibrate_rank(ctx: RankContext) -> Dict[str, Any]:
    """One rank of a calibration job: time every collective at every K (every rank)."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    from megatron_async.core import coordination

    payload = ctx.payload
    group = coordination.get_coordination_group(payload["collective_timeout_s"])
    wrapper = _DistWrapper(group, True, 0)  # as the saver makes it: coordinator rank 0
    times, num_bytes, decode = {}, {}, {}
    for items in payload["items_per_rank"]:
        ours = synthesize_rank(payload["layout"], ctx.rank, ctx.world_size, items, True)
        dcp = synthesize_rank(payload["layout"], ctx.rank, ctx.world_size, items, False)
        for op, (call, shipped) in _rank_ops(wrapper, ours, dcp).items():
            if op in payload["ops"]:
                times[op, items] = _timed(call, payload["repeats"], group)
                num_bytes[op, items] = 0 if shipped is None else pickled_bytes(shipped)
                if ctx.rank == 0:
                    decode[op, items] = _decode_s(shipped, ctx.world_size, payload["repeats"])
    return {"times": times, "bytes": num_bytes, "decode": decode}


def _decode_s(shipped: Any, world_size: int, repeats: int) -> float:
    """The coordinator's unpickling of every rank's object alone (its own, ``world_size``
    times; the others' have the same shape): the gather's serial floor, which more cores
    or a faster network do not shorten."""
    if shipped is None:
        return 0.0
    data = pickle.dumps(shipped)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(world_size):
            pickle.loads(data)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def calibrate(ranks: Sequence[int], items_per_rank: Sequence[int], layout: str = "tp8",
              repeats: int = 5, ops: Sequence[str] = OPS, launch_timeout_s: float = 600.0,
              collective_timeout_s: float = 120.0, extrapolate: Sequence[Any] = (),
              log_path: str = None) -> Dict[str, Any]:
    """Launch one job per rank count; return the rows, the fits and the extrapolations.

    Runs in the launcher. Each row is one (collective, ranks, items per rank): the
    coordinator's median seconds and the bytes every rank shipped to it (its own included).

    Raises:
        LaunchError: a rank failed, or a launch ran past ``launch_timeout_s``.
    """
    load_before = _load()
    payload = {"layout": layout, "items_per_rank": list(items_per_rank), "repeats": repeats,
               "ops": list(ops), "collective_timeout_s": collective_timeout_s}
    rows = []
    for n in ranks:
        per_rank = launch(n, _calibrate_rank, payload, launch_timeout_s, log_path=log_path)
        for (op, items), times in per_rank[0]["times"].items():
            median = statistics.median(times)
            num_bytes = sum(r["bytes"][op, items] for r in per_rank)
            rows.append({"op": op, "ranks": n, "items_per_rank": items, "median_s": median,
                         "times_s": times, "num_bytes": num_bytes,
                         "decode_s": per_rank[0]["decode"][op, items],
                         "per_item_us": median / (n * items) * 1e6,
                         "per_mib_ms": median / (num_bytes / 2**20) * 1e3 if num_bytes else None})
            print(_row(rows[-1]), flush=True)
    fits = fit(rows)
    extrapolated = []
    for n, items in extrapolate:
        for op, model in fits.items():
            num_bytes = modelled_bytes(model, n, items)
            extrapolated.append({"op": op, "ranks": n, "items_per_rank": items,
                                 "num_bytes": num_bytes,
                                 "estimate_s": estimate_s(model, n, num_bytes),
                                 "decode_s": model["decode_per_byte_s"] * num_bytes})
    source = (f"{','.join(map(str, ranks))} ranks x {','.join(map(str, items_per_rank))} items, "
              f"{layout}, gloo on loopback, {os.cpu_count()} CPUs, load {load_before} -> {_load()}")
    return {"source": source, "layout": layout, "repeats": repeats, "rows": rows,
            "fits": fits, "extrapolated": extrapolated}


def _row(r: Dict[str, Any]) -> str:
    per_mib = "-" if r["per_mib_ms"] is None else f"{r['per_mib_ms']:.2f} ms"
    return (f"| {r['op']} | {r['ranks']} x {r['items_per_rank']} | {r['median_s'] * 1e3:.2f} ms | "
            f"{r['decode_s'] * 1e3:.2f} ms | {r['num_bytes'] / 1024:.0f} KiB | "
            f"{r['per_item_us']:.2f} us | {per_mib} |")


def render(calibration: Dict[str, Any]) -> str:
    """The calibration as markdown: measured rows, fits, extrapolations."""
    lines = [f"Measured: {calibration['source']}; median of {calibration['repeats']}.", "",
             "| collective | ranks x items per rank | coordinator, median | of which unpickling | "
             "gathered | per item | per MiB |", "| --- | --- | --- | --- | --- | --- | --- |",
             *(_row(r) for r in calibration["rows"]), "",
             "| collective | fixed | per rank | per MiB | unpickling per MiB | bytes per item |",
             "| --- | --- | --- | --- | --- | --- |"]
    for op, m in calibration["fits"].items():
        lines.append(f"| {op} | {m['fixed_s'] * 1e3:.2f} ms | {m['per_rank_s'] * 1e3:.3f} ms | "
                     f"{m['per_byte_s'] * 2**20 * 1e3:.2f} ms | "
                     f"{m['decode_per_byte_s'] * 2**20 * 1e3:.2f} ms | {m['bytes_per_item']:.0f} |")
    if calibration["extrapolated"]:
        lines += ["", "Extrapolated from the fit (a few ranks on one host, loopback: a real "
                  "network adds its own time):", "",
                  "| collective | ranks x items per rank | gathered | estimate | "
                  "of which unpickling |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {e['op']} | {e['ranks']} x {e['items_per_rank']} | "
                  f"{e['num_bytes'] / 2**20:.0f} MiB | {e['estimate_s']:.2f} s | "
                  f"{e['decode_s']:.2f} s |"
                  for e in calibration["extrapolated"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=_ints, default=_ints("2,4,8"))
    parser.add_argument("--items-per-rank", type=_ints, default=_ints("100,300,1000"))
    parser.add_argument("--layout", choices=LAYOUTS, default="tp8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ops", type=lambda t: t.split(","), default=list(OPS))
    parser.add_argument("--extrapolate", type=_sizes, default=_sizes(_EXTRAPOLATE),
                        help=f"ranks x items pairs to extrapolate to (default {_EXTRAPOLATE})")
    parser.add_argument("--launch-timeout-s", type=float, default=600.0)
    parser.add_argument("--collective-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", default="bench_scale")
    args = parser.parse_args(argv)
    unknown = set(args.ops) - set(OPS)
    if unknown:
        parser.error(f"unknown --ops {sorted(unknown)}; choose from {', '.join(OPS)}")
    os.makedirs(args.out, exist_ok=True)
    calibration = calibrate(args.ranks, args.items_per_rank, args.layout, args.repeats, args.ops,
                            args.launch_timeout_s, args.collective_timeout_s, args.extrapolate,
                            os.path.join(args.out, "gather_calibration.log"))
    report = render(calibration)
    with open(os.path.join(args.out, "gather_calibration.md"), "w") as stream:
        stream.write(report + "\n")
    with open(os.path.join(args.out, "gather_calibration.json"), "w") as stream:
        json.dump(calibration, stream, indent=1)
    print(report)
    print(f"wrote {args.out}/gather_calibration.md, gather_calibration.json")


if __name__ == "__main__":
    main()
