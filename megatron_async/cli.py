"""Command line: ``python -m megatron_async {inspect,verify,list} ...``.

Runs in one process, on any machine that can read the checkpoint; no GPU and no
torch.distributed needed. Each command imports only what it needs: ``list`` neither
torch nor megatron-core, ``inspect`` and ``verify`` torch (to read DCP's metadata).

* ``inspect CKPT``: format, completeness, iteration, tensors (global shape, dtype,
  bytes), files and sizes; ``--json`` for machines.
* ``verify CKPT``: completeness and recorded checksums; exit code 0 only when intact.
* ``list SAVE_DIR``: the ``iter_*`` checkpoints of a Megatron save directory, which are
  complete and which one the tracker points to.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
from typing import List, Optional

from megatron_async.checkpoint_dirs import list_checkpoints, read_tracker
from megatron_async.errors import ObjectStoreError, ObjectStoreUnavailableError

__all__ = ["EXIT_CLOSED_PIPE", "main"]


def _human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.2f} TiB"


def _cmd_inspect(args: argparse.Namespace) -> int:
    from megatron_async.integrity.inspection import summarize_checkpoint

    summary = summarize_checkpoint(args.checkpoint)
    if args.json:
        json.dump(summary.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"checkpoint  {summary.path}")
    fmt = f"{summary.format} v{summary.format_version}" if summary.format else "unknown (no metadata.json)"
    print(f"format      {fmt}")
    print(f"iteration   {summary.iteration if summary.iteration is not None else '-'}")
    print(f"complete    {'yes' if summary.complete else 'NO'}")
    for problem in summary.problems:
        print(f"  problem: {problem}")
    if summary.tensors:
        name_width = min(max(len(t.name) for t in summary.tensors), 60)
        print(f"\ntensors ({len(summary.tensors)})")
        for tensor in summary.tensors:
            shape = "x".join(str(d) for d in tensor.global_shape) or "scalar"
            print(
                f"  {tensor.name:<{name_width}}  {shape:>18}  {tensor.dtype:<9} "
                f"{_human_bytes(tensor.num_bytes):>11}  {tensor.num_chunks} chunk(s)"
            )
    if summary.objects:
        print(f"\nobjects ({len(summary.objects)}): " + ", ".join(summary.objects[:20])
              + (" ..." if len(summary.objects) > 20 else ""))
    print(f"\nfiles ({len(summary.files)})")
    for entry in summary.files:
        print(f"  {entry.name:<40} {_human_bytes(entry.num_bytes):>11}")
    print(f"total       {_human_bytes(summary.total_bytes)}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from megatron_async.integrity.verify import find_damage

    problems, num_items = find_damage(args.checkpoint)
    if problems:
        print(f"DAMAGED: {args.checkpoint}")
        for problem in problems:
            print(f"  {problem}")
        return 1
    if num_items is None:
        print(f"COMPLETE (no checksums recorded, content not verified): {args.checkpoint}")
    else:
        print(f"INTACT: {args.checkpoint} ({num_items} items, checksums match)")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    tracked = read_tracker(args.save_dir)
    found = list_checkpoints(args.save_dir)
    if args.json:
        json.dump(
            {
                "save_dir": args.save_dir,
                "tracker_iteration": tracked,
                "checkpoints": [
                    {"iteration": c.iteration, "path": c.path, "complete": c.complete,
                     "tracked": c.iteration == tracked}
                    for c in found
                ],
            },
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
        return 0
    if not found:
        print(f"no iter_* checkpoints under {args.save_dir}")
    for info in found:
        marker = "  <- tracker" if info.iteration == tracked else ""
        state = "complete" if info.complete else "INCOMPLETE"
        print(f"iter {info.iteration:>9}  {state:<10}  {info.path}{marker}")
    if tracked is not None and all(info.iteration != tracked for info in found):
        print(f"warning: the tracker points to iteration {tracked}, which has no directory")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_async", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_cmd = commands.add_parser("inspect", help="describe a torch_dist checkpoint")
    inspect_cmd.add_argument("checkpoint")
    inspect_cmd.add_argument("--json", action="store_true", help="print JSON")
    inspect_cmd.set_defaults(handler=_cmd_inspect)
    verify_cmd = commands.add_parser("verify", help="check completeness and checksums (exit 0 if intact)")
    verify_cmd.add_argument("checkpoint")
    verify_cmd.set_defaults(handler=_cmd_verify)
    list_cmd = commands.add_parser("list", help="list the checkpoints of a Megatron save directory")
    list_cmd.add_argument("save_dir")
    list_cmd.add_argument("--json", action="store_true", help="print JSON")
    list_cmd.set_defaults(handler=_cmd_list)
    return parser


EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE
"""The exit status when the reader of stdout went away (``... | head``): what a shell
reports for a Unix tool that SIGPIPE ended."""


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command; return its exit status (0 ok, 1 damaged, 2 unreadable store).

    A closed stdout (``inspect CKPT | head``) ends the command quietly with
    :data:`EXIT_CLOSED_PIPE`. SIGPIPE itself stays ignored, as Python sets it, so that a
    connection to an object store that breaks is still an error with a traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        status = args.handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return status
    except BrokenPipeError:
        if not _discard_closed_stdout():
            raise  # not our stdout: a connection the command used broke
        return EXIT_CLOSED_PIPE
    except (ObjectStoreError, ObjectStoreUnavailableError) as exc:
        # An msc:// URL whose store cannot be read: the message names the URL and the fix.
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _discard_closed_stdout() -> bool:
    """If stdout is a pipe whose reader has gone, point it at /dev/null and return True.

    The interpreter's last flush of what is still buffered then neither fails nor prints
    a traceback. Linux reports a pipe without readers as ``POLLERR`` to its writer.
    """
    try:
        stdout_fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a capture (tests): no descriptor
        return False
    poller = select.poll()
    poller.register(stdout_fd, select.POLLOUT)
    if not any(events & select.POLLERR for _, events in poller.poll(0)):
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stdout_fd)
    finally:
        os.close(devnull)
    return True
