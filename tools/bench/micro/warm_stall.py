"""Micro-benchmark: the warm stall of many small tensors against one memory copy of them.

One rank (a one-process gloo group) holds ``--tensors`` tensors of ``--tensor-bytes``
each (float32), saves them ``--saves`` times through megatron-core's
``dist_checkpointing.save`` with our strategy as Megatron-LM configures it for
``--async-save --ckpt-assume-constant-structure`` (cached structure, sharding validation
only on the first save), and schedules each save on our queue (persistent or temporal
caller). Between saves it updates every tensor in place (a training step) and waits
until the checkpoint is complete, so each stall is a warm save's alone.

The stall runs from the ``dist_checkpointing.save`` call until
``schedule_async_request`` returns. It is compared with one memory copy of the same
bytes (``dst.copy_(src)`` of one flat tensor into a touched buffer, best of five), the
issue's target being ``stall <= 1.5 x memcpy + 5 ms``. With ``--phases`` it also prints our
part of the stall (the ``common.pt`` guard, ``async_save``, the scheduling) against that
target, and the rest:
megatron-core's own work in ``save()`` before it calls the strategy, which no strategy
can shorten. With ``--profile`` the last warm
save's call runs under cProfile, sorted by own time and by cumulative time; with
``--phases`` the main steps of every save are timed without a profiler (each function
wrapped in this process only) and their medians over the warm saves printed::

    python -m tools.bench.micro.warm_stall --callers persistent,temporal --saves 12
    python -m tools.bench.micro.warm_stall --callers persistent --profile
    python -m tools.bench.micro.warm_stall --phases
    python -m tools.bench.micro.warm_stall --callers persistent --overlap
    python -m tools.bench.micro.warm_stall --device cuda --callers persistent --phases

With ``--device cuda`` the tensors live on the GPU, the stall is compared with one
device-to-host copy of the same bytes into pinned memory, and two more copies are timed
beside it: one copy per tensor into pinned memory (what a copy per tensor costs on top),
and a device-side gather (``torch.cat`` on the GPU) followed by one copy (what gathering
first would cost). Together they say whether many small device tensors are worth
gathering before the copy (issue 24, item 4).

To compare revisions, run it with an extracted older ``megatron_async`` first on the
path (``python -m`` puts the current folder first, so run that one from the extracted
folder, with this repository on ``PYTHONPATH`` for the tools; the first line printed
says which package was timed)::

    git archive 9ac096e megatron_async | tar -x -C /tmp/before
    (cd /tmp/before && PYTHONPATH="$OLDPWD" python -m tools.bench.micro.warm_stall)

Tooling only: it prints, and never changes the library.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import tempfile
import time
from typing import Dict, List

import torch
import torch.distributed as dist

_COPY_REPEATS = 5


def memcpy_seconds(num_bytes: int) -> float:
    """Best of a few ``dst.copy_(src)`` of ``num_bytes`` (one flat tensor, touched buffers)."""
    src = torch.rand(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(_COPY_REPEATS):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def device_copy_seconds(tensors: List[torch.Tensor]) -> Dict[str, float]:
    """Best of a few device-to-host copies of ``tensors`` (1-D, on one CUDA device) into one
    pinned buffer: as one flat copy, one copy per tensor, and a device gather + one copy."""
    flat = torch.cat(tensors)  # the gather's device scratch, and the flat copy's source
    pinned = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
    pinned_parts = list(pinned.split([t.numel() for t in tensors]))

    def best(copy) -> float:
        copy()
        torch.cuda.synchronize()
        fastest = float("inf")
        for _ in range(_COPY_REPEATS):
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            fastest = min(fastest, time.perf_counter() - start)
        return fastest

    return {
        "one flat copy": best(lambda: pinned.copy_(flat, non_blocking=True)),
        "one copy per tensor": best(
            lambda: torch._foreach_copy_(pinned_parts, tensors, non_blocking=True)),
        "device gather + one copy": best(
            lambda: pinned.copy_(torch.cat(tensors, out=flat), non_blocking=True)),
    }


_PHASES = (
    # (module, attribute, label): the steps of a warm save on the training thread
    ("megatron.core.dist_checkpointing.serialization", "save_preprocess",
     "megatron-core save_preprocess"),
    ("megatron.core.dist_checkpointing.strategies.common", "TorchCommonSaveStrategy.save_common",
     "megatron-core common.pt (rank 0)"),
    ("megatron_async.mcore.strategy", "TorchDistAsyncSaveStrategy.async_save", "our async_save"),
    ("megatron_async.mcore.plan_cache", "describe_structure", "  structure fingerprint"),
    ("megatron_async.mcore.plan_cache", "rebind", "  rebind to the new tensors"),
    ("megatron_async.writer.filesystem", "FileSystemWriterAsync.prepare_resolved_write_data",
     "  buckets of the cached layout"),
    ("megatron_async.staging.buffers", "stage_buckets", "staging (copy into shared memory)"),
    ("megatron_async.core.request_transport", "RequestSender.encode",
     "encoding the request (persistent)"),
    ("megatron_async.core.temporal", "TemporalAsyncCaller.schedule_async_call",
     "temporal schedule (staging + fork)"),
    ("megatron_async.core.queue", "AsyncCallsQueue.schedule_async_request",
     "scheduling (staging included)"),
)


def time_phases() -> Dict[str, List[float]]:
    """Wrap the functions of :data:`_PHASES` with timers (this process only); return the log.

    A megatron-core step that this generation does not have (its ``common.pt`` strategy is
    gone from 0.17) is left out of the log; a missing step of ours is an error.
    """
    import functools
    import importlib

    log: Dict[str, List[float]] = {}
    for module_name, attribute, label in _PHASES:
        owner = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        try:
            for part in path:
                owner = getattr(owner, part)
            original = getattr(owner, name)
        except AttributeError:
            if module_name.startswith("megatron.core."):
                continue
            raise

        def timed(*args, __original=original, __label=label, **kwargs):
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                log.setdefault(__label, []).append(time.perf_counter() - start)

        setattr(owner, name, functools.wraps(original)(timed))
    return log


def _report(profile: cProfile.Profile, sort: str, lines: int) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(sort).print_stats(lines)
    return out.getvalue()


def run_caller(persistent: bool, tensors: List[torch.Tensor], saves: int, workdir: str,
               profile: bool, lines: int, gap_s: float = 0.0,
               overlap: bool = False) -> Dict[str, object]:
    """Save ``tensors`` ``saves`` times with one caller; return the stalls (seconds).

    With ``overlap`` each save is scheduled without waiting for the previous one's write
    (saves more frequent than a write takes): its staging cannot reuse buffers that a
    write still reads."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import megatron_async

    strategy = megatron_async.TorchDistAsyncSaveStrategy(thread_count=2)
    strategy.use_cached_ckpt_structure = True  # --ckpt-assume-constant-structure
    queue = megatron_async.AsyncCallsQueue(
        persistent=persistent, config=megatron_async.AsyncCallerConfig(poll_interval_s=0.005))
    if persistent:
        deadline = time.monotonic() + 120
        while not queue.persistent_caller.is_worker_ready() and time.monotonic() < deadline:
            time.sleep(0.05)
    stalls: List[float] = []
    profiler = cProfile.Profile()
    try:
        for index in range(saves):
            directory = os.path.join(workdir, f"iter_{index:07d}")
            os.makedirs(directory)
            state = {
                "iteration": index,
                "weights": {
                    f"t{i}": ShardedTensor.from_rank_offsets(f"weights.t{i}", tensor)
                    for i, tensor in enumerate(tensors)
                },
            }
            last = profile and index == saves - 1
            start = time.perf_counter()
            if last:
                profiler.enable()
            request = dist_checkpointing.save(
                state, directory, sharded_strategy=strategy, async_sharded_save=True,
                validate_access_integrity=index == 0)
            queue.schedule_async_request(request)
            if last:
                profiler.disable()
            stalls.append(time.perf_counter() - start)
            torch._foreach_add_(tensors, 1.0)  # the training step while the write runs
            if tensors[0].is_cuda:
                torch.cuda.synchronize()  # the next stall is the save's alone
            queue.maybe_finalize_async_calls(blocking=not overlap)
            if index > 0 and not overlap:
                shutil.rmtree(os.path.join(workdir, f"iter_{index - 1:07d}"), ignore_errors=True)
            time.sleep(gap_s)  # the rest of the training between two saves
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    result: Dict[str, object] = {"stalls": stalls, "reused": strategy.plan_cache.structure_reuse_count}
    if profile:
        result["profile"] = (_report(profiler, "tottime", lines), _report(profiler, "cumulative", lines))
    return result


def _our_share(phases: Dict[str, List[float]], stalls: List[float]):
    """Medians over the warm saves of (our part of the stall, the rest): our part is
    ``async_save`` and the scheduling, timed per save (our ``common.pt`` guard on
    0.16-0.18, a few checks, is timed within megatron-core's ``common.pt`` phase);
    None without ``--phases``."""
    ours = [a + s for a, s in zip(phases.get("our async_save", []),
                                  phases.get("scheduling (staging included)", []))]
    if len(ours) != len(stalls) or len(stalls) < 2:
        return None
    return (statistics.median(ours[1:]),
            statistics.median(stall - mine for stall, mine in zip(stalls[1:], ours[1:])))


def _staging_copy_threads() -> int:
    try:  # older revisions (timed with this tool for before/after) copy on one thread
        from megatron_async.staging.flat_copy import copy_threads
    except ImportError:
        return 1
    return copy_threads()


def _parse_bytes(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=4000)
    parser.add_argument("--tensor-bytes", default="16KiB")
    parser.add_argument("--saves", type=int, default=10, help="saves per caller; the first is cold")
    parser.add_argument("--callers", default="persistent,temporal")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the tensors live (cuda: the stall is compared with one "
                             "device-to-host copy into pinned memory)")
    parser.add_argument("--gap-s", type=float, default=0.0,
                        help="seconds of 'training' after a save is complete, before the next "
                             "(lets the previous save's write-back and clean-up settle, as "
                             "minutes of training between saves do)")
    parser.add_argument("--overlap", action="store_true",
                        help="schedule each save without waiting for the previous one's write "
                             "(saves more frequent than a write takes)")
    parser.add_argument("--profile", action="store_true", help="cProfile the last save's call")
    parser.add_argument("--lines", type=int, default=35, help="rows of each profile")
    parser.add_argument("--phases", action="store_true",
                        help="time the main steps of each save (medians of the warm saves)")
    args = parser.parse_args(argv)

    import megatron_async

    print(f"megatron_async from {os.path.dirname(megatron_async.__file__)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    tensor_bytes = _parse_bytes(args.tensor_bytes)
    workdir = tempfile.mkdtemp(prefix="megatron_async_warm_stall_")
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=0, world_size=1)
    torch.set_num_threads(1)
    tensors = [torch.rand(tensor_bytes // 4, device=args.device) for _ in range(args.tensors)]
    total = args.tensors * (tensor_bytes // 4) * 4
    phases = time_phases() if args.phases else {}
    try:
        copies = device_copy_seconds(tensors) if args.device == "cuda" else {}
        memcpy_s = copies["one flat copy"] if copies else memcpy_seconds(total)
        what = "one device-to-host copy" if copies else "one memory copy"
        print(f"{args.tensors} tensors x {tensor_bytes} B = {total / 2**20:.1f} MiB, 1 rank; "
              f"{what} {memcpy_s * 1e3:.1f} ms; target 1.5 x memcpy + 5 ms = "
              f"{(1.5 * memcpy_s + 0.005) * 1e3:.1f} ms")
        for label, seconds in copies.items():
            print(f"  device-to-host, {label}: {seconds * 1e3:.1f} ms "
                  f"({total / seconds / 1e9:.1f} GB/s)")
        threads = _staging_copy_threads()
        if threads > 1 and not copies:  # staging copies a CPU bucket on several threads
            torch.set_num_threads(threads)
            print(f"one memory copy on {threads} threads (torch's own parallel copy_, the "
                  f"threads staging may use): {memcpy_seconds(total) * 1e3:.1f} ms")
            torch.set_num_threads(1)
        for caller in args.callers.split(","):
            run_dir = os.path.join(workdir, caller)
            os.makedirs(run_dir)
            phases.clear()
            result = run_caller(caller == "persistent", tensors, args.saves, run_dir,
                                args.profile, args.lines, args.gap_s, args.overlap)
            warm = result["stalls"][1:]
            median = statistics.median(warm)
            print(f"{caller}: warm stall median {median * 1e3:.1f} ms = {median / memcpy_s:.2f} x "
                  f"memcpy (min {min(warm) * 1e3:.1f}, max {max(warm) * 1e3:.1f}; first "
                  f"{result['stalls'][0] * 1e3:.1f} ms; {result['reused']} saves reused the plan)")
            for label in [label for _, _, label in _PHASES if label in phases]:
                seconds = phases[label]
                print(f"  {label:36s} {statistics.median(seconds[1:] or seconds) * 1e3:6.1f} ms")
            ours = _our_share(phases, result["stalls"])
            if ours is not None:
                target_s = 1.5 * memcpy_s + 0.005
                print(f"  ours (guard + async_save + scheduling), median {ours[0] * 1e3:.1f} ms = "
                      f"{ours[0] / target_s:.2f} x the target; megatron-core's own part of the "
                      f"stall (preprocessing, common.pt, its save()) {ours[1] * 1e3:.1f} ms")
            if args.profile:
                by_own, by_cumulative = result["profile"]
                print(f"== {caller}: the last save's call, by own time ==\n{by_own}")
                print(f"== {caller}: by cumulative time ==\n{by_cumulative}")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
