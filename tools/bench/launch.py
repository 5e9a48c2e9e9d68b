"""Start N ranks as spawned processes, run one job on each, collect what each returns.

CPU-only hosts get a gloo process group; with CUDA every rank takes device
``rank % device_count`` and the group is ``cpu:gloo,cuda:nccl`` (DCP's ``async_save``
needs a CPU backend). A launch that raises on any rank, loses a rank or runs past its
timeout kills every rank together with its children and raises :class:`LaunchError`
carrying each rank's traceback. Before a launch that ran past its timeout is killed, every
rank (and every background process it forked) writes the Python stacks of all its threads
to its log, so a method that hangs says where.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import socket
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

import multiprocessing as mp
from multiprocessing import connection as mp_connection

__all__ = ["RankContext", "LaunchError", "launch"]


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a job gets on every rank."""

    rank: int
    world_size: int
    payload: Dict[str, Any]


class LaunchError(RuntimeError):
    """A launch failed: a rank raised, died, or the launch ran past its timeout."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _silence_known_warnings() -> None:
    for message in (
        "Transformer Engine and Apex are not installed",
        "Apex is not installed",
        "full scope is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message)


def _torchrun_env(rank: int, world_size: int, port: int) -> Dict[str, str]:
    """The variables torchrun would set for ``rank`` on a single node."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    for prefix in ("", "LOCAL_"):
        env[f"{prefix}RANK"] = rank
        env[f"{prefix}WORLD_SIZE"] = world_size
    return {name: str(value) for name, value in env.items()}


def _rank_main(rank: int, world_size: int, port: int, threads: int, log_path, job, payload,
               result_conn) -> None:
    """Body of one rank (spawned process)."""
    if log_path is not None:
        # Everything the rank and its background processes print goes to the log file.
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    # Stacks on SIGUSR1 (sent by the launcher before it kills a launch that ran past its
    # timeout); forked children inherit the handler, spawned ones do not.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(_torchrun_env(rank, world_size, port))
    # Inherited by the rank's background processes (forked writers, spawned workers).
    os.environ["OMP_NUM_THREADS"] = str(threads)
    _silence_known_warnings()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if torch.cuda.is_available():
            gpus = torch.cuda.device_count()
            if rank >= gpus:  # ranks share GPUs: NCCL needs a host identity per extra rank
                os.environ.setdefault("NCCL_HOSTID", f"bench-gpu-share-{rank}")
            torch.cuda.set_device(rank % gpus)
            backend = "cpu:gloo,cuda:nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        value = job(RankContext(rank, world_size, payload))
        result_conn.send(("ok", value))
        dist.destroy_process_group()
    except BaseException:  # reported to the launcher, which fails the whole launch
        result_conn.send(("error", traceback.format_exc()))
    finally:
        result_conn.close()


def _dump_stacks(ranks) -> None:
    """Ask every rank and its forked children to write their stacks to the log, then wait."""
    import psutil

    for process, _ in ranks:
        try:
            tree = psutil.Process(process.pid)
            for victim in [tree] + tree.children(recursive=True):
                victim.send_signal(signal.SIGUSR1)
        except (psutil.Error, TypeError):
            pass
    time.sleep(1.0)


def _kill_tree(process) -> None:
    """SIGKILL a rank and everything it started (best effort)."""
    import psutil

    if process.pid is None:
        return
    try:
        tree = psutil.Process(process.pid)
        victims = tree.children(recursive=True) + [tree]
    except psutil.Error:
        return
    for victim in victims:
        try:
            victim.kill()
        except psutil.Error:
            pass


def launch(
    world_size: int,
    job: Callable[[RankContext], Any],
    payload: Dict[str, Any],
    timeout_s: float,
    threads_per_rank: int = 1,
    log_path: Optional[str] = None,
) -> List[Any]:
    """Run ``job`` on ``world_size`` ranks; return each rank's value, in rank order.

    Args:
        world_size: number of ranks.
        job: a module-level function (it is pickled into spawned processes).
        payload: picklable options passed to every rank.
        timeout_s: bound on the whole launch.
        threads_per_rank: torch intra-op threads of each rank and of its background
            processes (``OMP_NUM_THREADS``); torchrun's default for multi-process jobs is 1.
        log_path: file that receives the ranks' standard output and error (appended);
            None leaves them on the launcher's.

    Raises:
        LaunchError: a rank raised or died, or the launch timed out.
    """
    ctx = mp.get_context("spawn")
    port = _free_port()
    ranks = []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        # Not daemonic: ranks start background processes of their own.
        process = ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, threads_per_rank, log_path, job, payload, child_conn),
            name=f"bench-rank-{rank}",
        )
        process.start()
        child_conn.close()
        ranks.append((process, parent_conn))

    deadline = time.monotonic() + timeout_s
    results: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    timed_out = False
    # Wait on each rank's pipe and on its process sentinel: a result or a death wakes us.
    waiting = {conn: rank for rank, (_, conn) in enumerate(ranks)}
    waiting.update({process.sentinel: rank for rank, (process, _) in enumerate(ranks)})
    try:
        while len(results) + len(errors) < world_size and not errors:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                where = ""
                if log_path is not None:
                    _dump_stacks(ranks)
                    where = f"; the ranks' stacks at the timeout are in {log_path}"
                raise LaunchError(
                    f"launch of {world_size} rank(s) ran past {timeout_s:.0f}s; every rank was "
                    f"killed (raise --launch-timeout-s for big sizes on slow disks){where}"
                )
            for ready in mp_connection.wait(list(waiting), timeout=remaining):
                rank = waiting.pop(ready)
                if rank in results or rank in errors:
                    continue
                _, conn = ranks[rank]
                if conn.poll():
                    try:
                        kind, value = conn.recv()
                    except EOFError:
                        kind, value = "error", f"rank {rank} closed its pipe without a result"
                    (results if kind == "ok" else errors)[rank] = value
                elif ready is not conn:
                    errors[rank] = f"rank {rank} died with exit code {ranks[rank][0].exitcode}"
        if errors:
            detail = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items()))
            raise LaunchError(f"{len(errors)} rank(s) failed:\n{detail}")
    finally:
        for process, conn in ranks:
            process.join(timeout=1 if errors or timed_out else 30)
            if process.is_alive():
                _kill_tree(process)
                process.join(timeout=5)
            conn.close()
    return [results[rank] for rank in range(world_size)]
