"""Command line: ``python -m megatron_async {inspect,verify,list} ...``.

Runs in one process, on any machine that can read the checkpoint; no GPU and no
torch.distributed needed.

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
import signal
import sys
from typing import List, Optional, Tuple

from megatron_async.checkpoint_dirs import list_checkpoints, read_tracker
from megatron_async.errors import ObjectStoreError, ObjectStoreUnavailableError

__all__ = ["EXIT_CLOSED_PIPE", "main"]


def _human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.2f} TiB"


def _cmd_inspect(args: argparse.Namespace) -> Tuple[int, str]:
    from megatron_async.integrity.inspection import summarize_checkpoint

    summary = summarize_checkpoint(args.checkpoint)
    if args.json:
        return 0, json.dumps(summary.to_json(), indent=2)
    fmt = f"{summary.format} v{summary.format_version}" if summary.format else "unknown (no metadata.json)"
    lines = [
        f"checkpoint  {summary.path}",
        f"format      {fmt}",
        f"iteration   {summary.iteration if summary.iteration is not None else '-'}",
        f"complete    {'yes' if summary.complete else 'NO'}",
    ]
    lines += [f"  problem: {problem}" for problem in summary.problems]
    if summary.tensors:
        name_width = min(max(len(t.name) for t in summary.tensors), 60)
        lines.append(f"\ntensors ({len(summary.tensors)})")
        for tensor in summary.tensors:
            shape = "x".join(str(d) for d in tensor.global_shape) or "scalar"
            lines.append(
                f"  {tensor.name:<{name_width}}  {shape:>18}  {tensor.dtype:<9} "
                f"{_human_bytes(tensor.num_bytes):>11}  {tensor.num_chunks} chunk(s)"
            )
    if summary.objects:
        lines.append(f"\nobjects ({len(summary.objects)}): " + ", ".join(summary.objects[:20])
                     + (" ..." if len(summary.objects) > 20 else ""))
    lines.append(f"\nfiles ({len(summary.files)})")
    lines += [f"  {entry.name:<40} {_human_bytes(entry.num_bytes):>11}" for entry in summary.files]
    lines.append(f"total       {_human_bytes(summary.total_bytes)}")
    return 0, "\n".join(lines)


def _cmd_verify(args: argparse.Namespace) -> Tuple[int, str]:
    from megatron_async.integrity.verify import find_damage

    problems, num_items = find_damage(args.checkpoint)
    if problems:
        return 1, "\n".join([f"DAMAGED: {args.checkpoint}"] + [f"  {problem}" for problem in problems])
    if num_items is None:
        return 0, f"COMPLETE (no checksums recorded, content not verified): {args.checkpoint}"
    return 0, f"INTACT: {args.checkpoint} ({num_items} items, checksums match)"


def _cmd_list(args: argparse.Namespace) -> Tuple[int, str]:
    tracked = read_tracker(args.save_dir)
    found = list_checkpoints(args.save_dir)
    if args.json:
        checkpoints = [
            {"iteration": c.iteration, "path": c.path, "complete": c.complete,
             "tracked": c.iteration == tracked}
            for c in found
        ]
        listing = {"save_dir": args.save_dir, "tracker_iteration": tracked, "checkpoints": checkpoints}
        return 0, json.dumps(listing, indent=2)
    lines = [] if found else [f"no iter_* checkpoints under {args.save_dir}"]
    for info in found:
        marker = "  <- tracker" if info.iteration == tracked else ""
        state = "complete" if info.complete else "INCOMPLETE"
        lines.append(f"iter {info.iteration:>9}  {state:<10}  {info.path}{marker}")
    if tracked is not None and all(info.iteration != tracked for info in found):
        lines.append(f"warning: the tracker points to iteration {tracked}, which has no directory")
    return 0, "\n".join(lines)


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

    A command reads everything before it prints, so a ``BrokenPipeError`` while reading
    (a connection to an object store that broke) keeps its traceback, while one while
    printing means the reader of stdout went away (``inspect CKPT | head``): the command
    then ends quietly with :data:`EXIT_CLOSED_PIPE`. SIGPIPE itself stays ignored, as
    Python sets it.
    """
    args = build_parser().parse_args(argv)
    try:
        status, text = args.handler(args)
    except (ObjectStoreError, ObjectStoreUnavailableError) as exc:
        # An msc:// URL whose store cannot be read: the message names the URL and the fix.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:
        # The interpreter's last flush of what is still buffered goes to /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_CLOSED_PIPE
    return status
