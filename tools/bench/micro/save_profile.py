"""Profile: where one warm save of the GPT example spends the training thread's time.

One rank (a one-process gloo group) trains the example's model with its distributed
optimizer, created in the example's order (the checkpointing queue first), saves
``--saves`` times with the flags of a lost-time method, and runs cProfile over the
last warm save's call (the stall) and over the finalize that commits it (after the
background write is over, so the finalize is timed alone). Prints the stalls of every
save and the two profiles, sorted by cumulative time::

    python -m tools.bench.micro.save_profile --method ours_persistent_overlap --hidden-size 512

The lost-time benchmark (``tools/benchmark.py --lost-time-only``) says how much a save
costs; this says where. Tooling only: it prints, and never changes the library.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from ..config import EXAMPLE_FLAGS, LOST_TIME_LOCAL_METHODS
from ..gpt_example import ExampleTrainer

_WRITE_SETTLE_S = 1.0
"""Pause before the finalize, so that the background write is over and not profiled."""


def _report(profile: cProfile.Profile, lines: int) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(lines)
    return out.getvalue()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    methods = sorted(m for m, flags in EXAMPLE_FLAGS.items() if "--replication" not in flags)
    parser.add_argument("--method", default="ours_persistent_overlap", choices=methods,
                        help="a lost-time method's flags (one rank: not a replicated one)")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=5, help="saves; the last one is profiled")
    parser.add_argument("--lines", type=int, default=40, help="rows of each profile")
    args = parser.parse_args(argv)

    workdir = tempfile.mkdtemp(prefix="megatron_async_save_profile_")
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=0, world_size=1)
    torch.set_num_threads(1)
    trainer = ExampleTrainer(args.num_layers, args.hidden_size, [
        "--train-iters", "1000000", "--save", os.path.join(workdir, "ckpt"),
        "--save-interval", "1", *EXAMPLE_FLAGS[args.method],
        "--non-persistent-local-ckpt-dir", os.path.join(workdir, "local")])
    from gpt.checkpointing import Checkpointer
    from gpt.save_strategy import create_checkpoint_queue

    queue = create_checkpoint_queue(trainer.args)
    trainer.build()
    trainer.step()
    checkpointer = Checkpointer(trainer.args, trainer.model, trainer.optimizer, queue)
    stalls = []
    save_profile, finalize_profile = cProfile.Profile(), cProfile.Profile()
    try:
        for index in range(args.saves):
            last = index == args.saves - 1
            trainer.step()
            start = time.perf_counter()
            if last:
                save_profile.enable()
            checkpointer.save(trainer.iteration, trainer.consumed,
                              local=args.method in LOST_TIME_LOCAL_METHODS)
            if last:
                save_profile.disable()
            stalls.append(time.perf_counter() - start)
            trainer.step()  # the optimizer step waits for an overlapped copy, as in training
            time.sleep(_WRITE_SETTLE_S)
            if last:
                finalize_profile.enable()
            checkpointer.maybe_finalize(blocking=True)
            if last:
                finalize_profile.disable()
    finally:
        checkpointer.close()
        dist.destroy_process_group()
        shutil.rmtree(workdir, ignore_errors=True)  # its checkpoints
    print(f"{args.method}, GPT {args.num_layers} x {args.hidden_size}, 1 rank: stalls (ms)",
          [round(s * 1e3, 1) for s in stalls])
    print("\n== the last save's call (the stall) ==\n" + _report(save_profile, args.lines))
    print("== its finalize (on the training thread) ==\n" + _report(finalize_profile, args.lines))


if __name__ == "__main__":
    main()
