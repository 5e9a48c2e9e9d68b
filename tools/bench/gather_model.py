"""What a save gathers on the coordinator, and a cost model of those gathers fitted on real ranks.

Runs in the benchmark's processes only (never in a training job):

* :func:`gathered_objects` says what one rank ships to the coordinator in each gather of a
  first save, for our saver and for PyTorch DCP: the scale benchmark
  (:mod:`tools.bench.scale`) measures their bytes and the coordinator's unpickling of them
  over N simulated ranks (:func:`measure_gathers`), and the calibration
  (:mod:`tools.bench.gather_calibration`) gathers the very same objects over real gloo ranks;
* :func:`fit` turns the calibration's medians into ``time = a + b * ranks + c * bytes``
  per collective, and :func:`estimate_s` evaluates it at any size;
* :func:`render_scale_estimates` folds the estimates into the scale report: plan, gather
  and commit per save, ours against DCP. A gather there is the calibrated transport (the
  fit less the unpickling it includes) plus the unpickling measured at that size, since
  the unpickling, serial on the coordinator, grows faster than the bytes (the cyclic GC).

Gathered bytes are what ``torch.distributed.gather_object`` pickles on each rank (the
same ``pickle`` default protocol); it pads every rank's object to the largest one, which
changes nothing here, as every rank of a layout ships the same size within a few bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from megatron_async.core.gc_pause import paused_gc

__all__ = [
    "GATHERS",
    "OPS",
    "gathered_objects",
    "pickled_bytes",
    "measure_gathers",
    "dcp_write_results",
    "fit",
    "modelled_bytes",
    "estimate_s",
    "render_scale_estimates",
]

GATHERS = ("plan_gather", "result_gather")
"""The two gathers of a first save: local plans (planning) and write results (finalize)."""

OPS = (
    "ours_plan_gather",
    "ours_result_gather",
    "ours_full_finalize",
    "warm_allreduces",
    "dcp_plan_gather",
    "dcp_result_gather",
)
"""What the calibration times: each method's two gathers; our full finalization's
collectives (two all-reduces and the gather, through the real
``save_state_dict_async_finalize``); a warm finalization's two all-reduces."""


def dcp_write_results(results: Sequence[Any]) -> List[Any]:
    """DCP's own write results for the same items (no checksum, DCP's dataclass pickling)."""
    from torch.distributed.checkpoint.storage import WriteResult

    return [WriteResult(r.index, r.size_in_bytes, r.storage_data) for r in results]


def gathered_objects(method: str, plan: Any, results: Sequence[Any]) -> Dict[str, Any]:
    """What one rank ships to the coordinator in each gather of a first save.

    Args:
        method: ``ours`` (the local plan with its digest, then our checksummed write
            results) or ``dcp`` (DCP's local plan, then DCP's write results).
        plan: the rank's local plan.
        results: the rank's write results (:func:`tools.bench.scale_plans.synthesize_rank`).
    """
    if method == "ours":
        from megatron_async.saver.metadata_cache import plan_digest

        return {"plan_gather": (plan, plan_digest(plan)), "result_gather": list(results)}
    if method == "dcp":
        return {"plan_gather": plan, "result_gather": dcp_write_results(results)}
    raise ValueError(f"no gathers are modelled for {method!r}; choose ours or dcp")


def pickled_bytes(obj: Any) -> int:
    """The size ``gather_object`` ships for ``obj``."""
    return len(pickle.dumps(obj))


def measure_gathers(method: str, plans: Sequence[Any], results: Sequence[Any]) -> Dict[str, Any]:
    """Each gather of a first save at full size: its bytes, and the coordinator's unpickling.

    ``gather_object`` unpickles every rank's object on the coordinator, one after the
    other: DCP with the cyclic GC running, ours with it paused (as the saver pauses it
    around its gathers). That serial part is measured here on all N objects; the
    transport is the calibration's to estimate.

    Returns:
        ``{gather: {"num_bytes": ..., "unpickle_s": ...}}`` for each of :data:`GATHERS`.
    """
    pickled: Dict[str, List[bytes]] = {gather: [] for gather in GATHERS}
    for plan, rank_results in zip(plans, results):
        for gather, obj in gathered_objects(method, plan, rank_results).items():
            pickled[gather].append(pickle.dumps(obj))
    measured = {}
    for gather, datas in pickled.items():
        pause = paused_gc() if method == "ours" else contextlib.nullcontext()
        start = time.perf_counter()
        with pause:
            objects = [pickle.loads(data) for data in datas]
        measured[gather] = {"num_bytes": sum(map(len, datas)),
                            "unpickle_s": time.perf_counter() - start}
        del objects
    return measured


def _nonnegative_lstsq(columns: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (best subset of columns; three at most).

    A plain fit on noisy medians from a few sizes can give a negative per-rank or fixed
    cost, which extrapolates to nonsense at thousands of ranks.
    """
    best, best_error = np.zeros(columns.shape[1]), float(np.sum(y ** 2))
    for count in range(1, columns.shape[1] + 1):
        for subset in itertools.combinations(range(columns.shape[1]), count):
            coef, *_ = np.linalg.lstsq(columns[:, subset], y, rcond=None)
            if np.any(coef < 0):
                continue
            error = float(np.sum((columns[:, subset] @ coef - y) ** 2))
            if error < best_error:
                best, best_error = np.zeros(columns.shape[1]), error
                best[list(subset)] = coef
    return best


def fit(rows: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Per op, ``time = a + b * ranks + c * bytes`` and ``bytes = p * ranks + q * items``.

    Args:
        rows: the calibration's rows (``op``, ``ranks``, ``items_per_rank``,
            ``median_s``, ``num_bytes``, ``decode_s``).

    Returns:
        ``{op: {fixed_s, per_rank_s, per_byte_s, bytes_per_rank, bytes_per_item,
        decode_per_byte_s}}``; the last is the coordinator's unpickling alone, per byte.
    """
    fits = {}
    for op in sorted({r["op"] for r in rows}):
        mine = [r for r in rows if r["op"] == op]
        ranks = np.array([r["ranks"] for r in mine], dtype=float)
        items = np.array([r["ranks"] * r["items_per_rank"] for r in mine], dtype=float)
        num_bytes = np.array([r["num_bytes"] for r in mine], dtype=float)
        times = np.array([r["median_s"] for r in mine], dtype=float)
        a, b, c = _nonnegative_lstsq(np.stack([np.ones_like(ranks), ranks, num_bytes], 1), times)
        p, q = _nonnegative_lstsq(np.stack([ranks, items], 1), num_bytes)
        decode = sum(r.get("decode_s", 0.0) for r in mine) / max(float(num_bytes.sum()), 1.0)
        fits[op] = {"fixed_s": float(a), "per_rank_s": float(b), "per_byte_s": float(c),
                    "bytes_per_rank": float(p), "bytes_per_item": float(q),
                    "decode_per_byte_s": decode}
    return fits


def modelled_bytes(model: Dict[str, float], ranks: int, items_per_rank: int) -> float:
    """The bytes one collective gathers at ``ranks x items_per_rank``, from the fit."""
    return (model["bytes_per_rank"] + model["bytes_per_item"] * items_per_rank) * ranks


def estimate_s(model: Dict[str, float], ranks: int, num_bytes: float) -> float:
    """The fitted time of one collective at ``ranks`` gathering ``num_bytes``."""
    return model["fixed_s"] + model["per_rank_s"] * ranks + model["per_byte_s"] * num_bytes


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _gather_s(model: Dict[str, float], ranks: int, measured: Dict[str, float]) -> float:
    """The calibrated transport (the fit less its unpickling) plus this size's unpickling."""
    num_bytes = measured["num_bytes"]
    transport = estimate_s(model, ranks, num_bytes) - model["decode_per_byte_s"] * num_bytes
    return max(transport, 0.0) + measured["unpickle_s"]


def render_scale_estimates(results: Sequence[Any], calibration: Dict[str, Any]) -> str:
    """The scale report's per-save table: plan, estimated gathers, commit, and their sum.

    Args:
        results: :class:`tools.bench.scale.ScaleResult` rows; those of ``ours``, ``dcp``
            and ``ours_warm`` get a row here.
        calibration: what :mod:`tools.bench.gather_calibration` wrote (its ``fits``).
    """
    fits = calibration["fits"]
    lines = [
        "| layout | ranks x items | method | plan | plan gather (est.) | commit | "
        "result gather (est.) | per save (est.) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if r.method == "ours_warm":
            plan_gather, result_gather = None, estimate_s(fits["warm_allreduces"], r.ranks, 0)
            cells = ["-", f"{_seconds(result_gather)} (-)"]
        elif r.method in ("ours", "dcp") and r.gathers:
            plan_gather, result_gather = (
                _gather_s(fits[f"{r.method}_{gather}"], r.ranks, r.gathers[gather])
                for gather in GATHERS
            )
            cells = [f"{_seconds(total)} ({r.gathers[gather]['unpickle_s']:.3f} s)"
                     for gather, total in zip(GATHERS, (plan_gather, result_gather))]
        else:
            continue
        plan = None if r.method == "ours_warm" else r.plan_s
        total = sum(v for v in (plan, plan_gather, r.commit_s, result_gather) if v is not None)
        lines.append(
            f"| {r.layout} | {r.ranks} x {r.items_per_rank} | {r.method} | {_seconds(plan)} | "
            f"{cells[0]} | {_seconds(r.commit_s)} | {cells[1]} | {_seconds(total)} |"
        )
    return "\n".join([
        f"Gathers: the transport calibrated on real gloo ranks ({calibration['source']}) "
        "plus, in brackets, the coordinator's unpickling of every rank's object, measured at "
        "this size (serial; ours with the cyclic GC paused, as our saver runs it, DCP with it "
        "running). ours_warm gathers nothing: its result "
        "column is its two all-reduces. DCP also scatters the global plans and broadcasts "
        "the metadata, which is not counted.",
        "",
        *lines,
    ])
