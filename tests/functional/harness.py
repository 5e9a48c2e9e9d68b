"""Launch real multi-rank gloo jobs from a pytest process, bounded in time.

A launch starts ``world_size`` spawned processes, initializes a gloo process group in
each and calls a *scenario entry point* ``"package.module:function"`` with
``(ctx: RankContext)``. Whatever the entry point returns (it must pickle) comes back
per rank. Starting ranks costs seconds (torch and megatron-core imports), so an entry
point usually runs several scenarios and returns a ``{scenario_name: outcome}`` dict:
use :func:`run_scenarios` for that, and one pytest test per scenario reads its outcome
from a module-scoped launch.

If any rank raises, exits early or the launch exceeds ``timeout_s``, every rank is
killed and :class:`LaunchError` reports each rank's traceback or exit code.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import multiprocessing as mp

__all__ = [
    "RankContext",
    "LaunchError",
    "launch",
    "launch_once",
    "selected_scenarios",
    "for_both_callers",
    "with_caller",
    "by_name",
    "only_selected",
    "run_scenarios",
    "ScenarioOutcome",
    "assert_scenario_ok",
]


@dataclasses.dataclass
class RankContext:
    """What a scenario entry point gets on each rank."""

    rank: int
    world_size: int
    tmp_dir: str
    options: Dict[str, Any]


class LaunchError(AssertionError):
    """A multi-rank launch failed: a rank raised, died or the launch timed out."""


@dataclasses.dataclass
class ScenarioOutcome:
    """Outcome of one scenario on one rank: ``error`` is None on success."""

    value: Any = None
    error: Optional[str] = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _resolve(entry: str) -> Callable[[RankContext], Any]:
    module_name, _, func_name = entry.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def _rank_main(rank, world_size, port, entry, tmp_dir, options, result_conn, env):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = _resolve(entry)(RankContext(rank, world_size, tmp_dir, options))
        result_conn.send(("ok", value))
        try:
            dist.destroy_process_group()
        except Exception:  # best effort: the launch already has its result
            pass
    except BaseException:  # report anything, including SystemExit, to the launcher
        result_conn.send(("error", traceback.format_exc()))
    finally:
        result_conn.close()


def launch(
    entry: str,
    world_size: int,
    tmp_dir: str,
    timeout_s: float = 180.0,
    options: Optional[Dict[str, Any]] = None,
    env: Optional[Dict[str, str]] = None,
) -> List[Any]:
    """Run ``entry`` on ``world_size`` gloo ranks and return each rank's result.

    Args:
        entry: ``"module:function"``; the function takes a :class:`RankContext`.
        world_size: number of ranks (2-4 in our tests).
        tmp_dir: a directory shared by all ranks (usually pytest's ``tmp_path``).
        timeout_s: bound on the whole launch; past it every rank is killed.
        options: picklable values handed to every rank as ``ctx.options``.
        env: extra environment variables for the ranks.

    Raises:
        LaunchError: a rank raised or died, or the launch timed out.
    """
    ctx = mp.get_context("spawn")
    port = _free_port()
    env = dict(env or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    procs, conns = [], []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, entry, tmp_dir, dict(options or {}), child_end, env),
            name=f"test-rank-{rank}",
        )
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)

    results: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    pending = set(range(world_size))
    try:
        while pending and time.monotonic() < deadline:
            for rank in list(pending):
                conn, proc = conns[rank], procs[rank]
                if conn.poll(0.05):
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        status, payload = "error", f"rank {rank} closed its pipe without a result"
                    (results if status == "ok" else errors)[rank] = payload
                    pending.discard(rank)
                elif not proc.is_alive() and not conn.poll(0):
                    errors[rank] = f"rank {rank} exited with code {proc.exitcode} and no result"
                    pending.discard(rank)
            if errors:
                # One rank failed: give the others a moment to report, then stop them.
                grace = time.monotonic() + 10.0
                while pending and time.monotonic() < grace:
                    for rank in list(pending):
                        if conns[rank].poll(0.05):
                            try:
                                status, payload = conns[rank].recv()
                            except EOFError:
                                status, payload = "error", "pipe closed"
                            (results if status == "ok" else errors)[rank] = payload
                            pending.discard(rank)
                break
        timed_out = bool(pending) and not errors
    finally:
        for proc in procs:
            if proc.is_alive():
                _dump_stacks_and_kill(proc)
        for proc in procs:
            proc.join(timeout=10)
    if timed_out:
        raise LaunchError(
            f"launch of {entry} on {world_size} ranks timed out after {timeout_s:.0f}s; "
            f"ranks without a result: {sorted(pending)}"
        )
    if errors or pending:
        report = "\n".join(f"=== rank {r} ===\n{text}" for r, text in sorted(errors.items()))
        raise LaunchError(f"launch of {entry} failed on ranks {sorted(errors)}:\n{report}")
    return [results[r] for r in range(world_size)]


_launch_cache: Dict[tuple, List[Any]] = {}


def launch_once(
    entry: str,
    world_size: int,
    tmp_path_factory,
    timeout_s: float = 240.0,
    only: Optional[List[str]] = None,
) -> List[Any]:
    """:func:`launch` ``entry`` on ``world_size`` ranks once per pytest session.

    For module-scoped fixtures: every test of a module reads its scenario's outcome
    from the same launch. ``only`` names the scenarios to run (None: all of them).
    """
    key = (entry, world_size, tuple(only) if only is not None else None)
    if key not in _launch_cache:
        name = entry.rsplit(":", 1)[0].rsplit(".", 1)[-1]
        tmp = tmp_path_factory.mktemp(f"{name}{world_size}")
        options = {"only": list(only)} if only is not None else {}
        _launch_cache[key] = launch(entry, world_size, str(tmp), timeout_s=timeout_s, options=options)
    return _launch_cache[key]


def selected_scenarios(request, test: Optional[str] = None,
                       registry: Optional[List[str]] = None) -> Optional[List[str]]:
    """The scenarios that the tests of the requesting module selected (``pytest -k``).

    ``test`` limits this to one test function of the module (by name), ``registry`` names
    the scenarios its launch can run (default: the module's ``SCENARIOS``). Returns None
    when every scenario of the registry is selected, so that the launch runs all its
    scenarios; otherwise the launch runs only these.
    """
    names, everything = [], True
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is not request.module or "scenario" not in params:
            continue
        if test is None or getattr(item, "originalname", None) == test:
            names.append(params["scenario"])
    if registry is None:
        registry = getattr(request.module, "SCENARIOS", None)
    if registry is not None:
        everything = set(names) >= set(registry)
    return None if everything else sorted(set(names))


def for_both_callers(*fns: Callable) -> Dict[str, Callable]:
    """Scenarios ``name[temporal]`` and ``name[persistent]`` of each ``fn(ctx, persistent)``."""
    return {
        f"{fn.__name__}[{kind}]": functools.partial(fn, persistent=kind == "persistent")
        for kind in ("temporal", "persistent")
        for fn in fns
    }


def with_caller(kind: str, *fns: Callable) -> Dict[str, Callable]:
    """Scenarios ``name[kind]`` of each ``fn(ctx, persistent)`` with one caller ``kind``
    (``"temporal"`` or ``"persistent"``): for behaviours that do not differ by caller."""
    if kind not in ("temporal", "persistent"):
        raise ValueError(f"caller kind {kind!r}: use 'temporal' or 'persistent'")
    return {f"{fn.__name__}[{kind}]": functools.partial(fn, persistent=kind == "persistent") for fn in fns}


def by_name(*fns: Callable) -> Dict[str, Callable]:
    """Scenarios named after their functions ``fn(ctx)``."""
    return {fn.__name__: fn for fn in fns}


def only_selected(ctx: RankContext, scenarios: Dict[str, Callable]) -> Dict[str, Callable]:
    """The scenarios ``ctx.options["only"]`` names, in registry order (all without it)."""
    only = ctx.options.get("only")
    if only is None:
        return scenarios
    unknown = set(only) - set(scenarios)
    if unknown:
        raise KeyError(f"unknown scenarios {sorted(unknown)}")
    return {name: fn for name, fn in scenarios.items() if name in only}


def _dump_stacks_and_kill(proc) -> None:
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    # Kill grandchildren (background writers) of the rank too: they are in no group of ours.
    try:
        import psutil

        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
    except Exception:
        pass


def run_selected_then_close(ctx: RankContext, scenarios: Dict[str, Callable], queues: Dict[Any, Any]):
    """Run the selected ``scenarios`` (:func:`run_scenarios`), then close every queue of
    ``queues`` (the launch's queues, one per caller kind) without waiting."""
    try:
        return run_scenarios(ctx, only_selected(ctx, scenarios))
    finally:
        for queue in queues.values():
            queue.close(abort=True)


def run_scenarios(ctx: RankContext, scenarios: Dict[str, Callable[[RankContext], Any]]):
    """Run named scenarios in order on this rank; return ``{name: ScenarioOutcome}``.

    A scenario that raises is recorded (with its traceback) and the next one runs, so
    one broken behaviour does not hide the others. Scenarios must keep collectives
    symmetric across ranks even when they fail (the coordination group's timeout
    bounds the damage if they do not).
    """
    import torch.distributed as dist

    outcomes: Dict[str, ScenarioOutcome] = {}
    for name, fn in scenarios.items():
        try:
            outcomes[name] = ScenarioOutcome(value=fn(ctx))
        except Exception:
            outcomes[name] = ScenarioOutcome(error=traceback.format_exc())
        try:
            dist.barrier()
        except Exception:
            outcomes[name + ".barrier"] = ScenarioOutcome(error=traceback.format_exc())
            break
    return outcomes


def assert_scenario_ok(per_rank: List[Dict[str, ScenarioOutcome]], name: str) -> List[Any]:
    """Fail the calling test with every rank's traceback if scenario ``name`` failed."""
    problems = []
    for rank, outcomes in enumerate(per_rank):
        outcome = outcomes.get(name)
        if outcome is None:
            problems.append(f"rank {rank}: scenario {name!r} did not run")
        elif outcome.error is not None:
            problems.append(f"rank {rank}:\n{outcome.error}")
    if problems:
        raise AssertionError(f"scenario {name!r} failed:\n" + "\n".join(problems))
    return [outcomes[name].value for outcomes in per_rank]


if __name__ == "__main__":  # pragma: no cover - manual debugging aid
    print(launch(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
