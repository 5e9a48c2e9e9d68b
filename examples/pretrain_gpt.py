"""Pretrain a small GPT with megatron-core; save torch_dist checkpoints with megatron_async.

Run on CPU (gloo) or GPU (NCCL), one process per rank::

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --train-iters 20 \\
        --save /tmp/ckpt --load /tmp/ckpt --save-interval 5 --async-save

Megatron-LM's local checkpoints save between persistent ones to node-local storage,
replicated to peer nodes, and a restart resumes from the newer tier::

    torchrun --nnodes 2 --node-rank R --nproc-per-node 2 ... examples/pretrain_gpt.py \\
        --save /shared/ckpt --load /shared/ckpt --save-interval 100 --async-save \\
        --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir /local/ckpt \\
        --non-persistent-save-interval 10 --replication --replication-jump 2

``--save``/``--load`` may be ``msc://PROFILE/PREFIX`` URLs (object storage through
multi-storage-client; ``--msc-config FILE`` names the profiles' configuration).

Read top to bottom: set up the process groups and the background-save queue, build
model, optimizer and data, resume from ``--load`` if there is a checkpoint, train, save
every ``--save-interval`` iterations (in the background with ``--async-save``), and wait
for the last save before exiting. Running the same command again resumes where the last
complete checkpoint left off and reproduces the losses of an uninterrupted run exactly.
"""

from __future__ import annotations

import logging
import os
import sys
import time

# gpt first: importing it quiets megatron-core's import-time notices about optional kernels.
from gpt import cpu_compat, torch_adam_compat

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from gpt.arguments import parse_args, validate_parallel_args
from gpt.checkpointing import Checkpointer, enable_object_storage
from gpt.data import build_dataset, micro_batches
from gpt.debug_hooks import DEBUG_CRASH_AFTER_ENV, crash_iteration
from gpt.devices import bind_rank_to_gpu
from gpt.local_checkpoints import serve_local_checkpointing
from gpt.model import build_model, build_optimizer, resolve_transformer_impl, set_seed, train_step
from gpt.progress import Progress, format_bytes
from gpt.save_strategy import create_checkpoint_queue


def report_saves(records, progress: Progress, finished: list) -> None:
    """Print what each finished save cost (rank 0) and add it to ``finished``."""
    finished.extend(records)
    for r in records:
        how = f"{r.background_s:.3f} s in the background" if r.is_async else "synchronously"
        size = format_bytes(r.num_bytes)
        what = (f"local checkpoint durable on every holder (rank 0 holds {size})" if r.local
                else f"durable: {size}")
        progress.event(
            f"[ckpt] iter {r.iteration} {what} written {how}, "
            f"{format_bytes(r.throughput_bytes_per_s)}/s; training stalled {r.stall_s:.3f} s",
            event="local_save" if r.local else "save", iteration=r.iteration,
            is_async=r.is_async, stall_s=r.stall_s,
            background_s=r.background_s, num_bytes=r.num_bytes, path=r.path,
        )


def report_failures(checkpointer: Checkpointer, progress: Progress) -> None:
    """Print each save that failed while training went on (--ckpt-save-failure continue)."""
    for iteration in checkpointer.take_failed_iterations():
        progress.event(f"[ckpt] iter {iteration}: save failed (see the error above); training "
                       "goes on, the next interval saves again", event="save_failed",
                       iteration=iteration)


def save_checkpoint(checkpointer: Checkpointer, iteration: int, consumed_samples: int,
                    progress: Progress, local: bool = False) -> None:
    """Save (or schedule) a checkpoint and print how long training was blocked."""
    record = checkpointer.save(iteration, consumed_samples, local=local)
    if record is None:  # failed under --ckpt-save-failure continue: reported below
        report_failures(checkpointer, progress)
        return
    what = "async save scheduled" if record.is_async else "saved"
    if local:
        what = f"local {what}"
    progress.event(f"[ckpt] iter {iteration}: {what}, training stalled {record.stall_s:.3f} s")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.object_storage:  # msc:// --save/--load: object storage through multi-storage-client
        enable_object_storage(args.msc_config)
    if args.non_persistent_ckpt_type == "local":
        # nvidia-resiliency-ext's local checkpointing, served by megatron_async.
        serve_local_checkpointing()

    # Process groups: NCCL with GPUs, gloo on a CPU-only host (megatron-core then needs
    # the patches of gpt/cpu_compat.py).
    if torch.cuda.is_available():
        bind_rank_to_gpu(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    cpu_compat.install()
    torch_adam_compat.install()  # megatron-core over torch's Adam, CPU and GPU alike
    validate_parallel_args(args, dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    rank = dist.get_rank()
    logging.basicConfig(level=logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    args.transformer_impl = resolve_transformer_impl(args.transformer_impl)
    set_seed(args.seed)
    progress = Progress(args.train_iters, enabled=rank == 0, log_interval=args.log_interval,
                        metrics_file=args.metrics_file)
    optimizer_kind = "plain"
    if args.use_distributed_optimizer:
        optimizer_kind = ("distributed (fully reshardable checkpoints)"
                          if args.dist_ckpt_optim_fully_reshardable else "distributed")
    save_kind = "sync"
    if args.async_save:
        save_kind = "async (persistent worker)" if args.use_persistent_ckpt_worker else "async"
    progress.event(
        f"GPT {args.num_layers}x{args.hidden_size} ({args.transformer_impl} layers) on "
        f"{dist.get_world_size()} rank(s): TP={args.tensor_model_parallel_size} "
        f"PP={args.pipeline_model_parallel_size} DP={args.data_parallel_size}, "
        f"{optimizer_kind} optimizer, {save_kind} saves"
    )

    # The background-save queue before the model (Megatron-LM's init_persistent_async_worker):
    # a worker forked now shares none of the model's memory with the trainer.
    save_queue = create_checkpoint_queue(args)

    # Model, optimizer, data.
    model = build_model(args)
    optimizer = build_optimizer(args, model)
    dataset = build_dataset(args)
    checkpointer = Checkpointer(args, model, optimizer, save_queue)

    # Resume: model, optimizer, RNG states, iteration and data position.
    iteration, consumed_samples, last_saved = 0, 0, None
    resumed = checkpointer.load()
    if resumed is not None:
        iteration, consumed_samples = resumed.iteration, resumed.consumed_samples
        last_saved = iteration
        path = resumed.point.path if resumed.point is not None else None
        progress.event(resumed.describe(), event="resume", iteration=iteration, path=path,
                       tier="persistent" if path else "local")
        if rank != 0:  # the tier is agreed; every rank says what it loaded
            print(f"[rank {rank}] {resumed.describe()}", flush=True)
    else:
        progress.event("starting from scratch")

    # Train. Every iteration first finalizes the saves that are done on every rank.
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    saves = []
    crash_after = crash_iteration()
    start = time.perf_counter()
    while iteration < args.train_iters:
        report_saves(checkpointer.maybe_finalize(blocking=False), progress, saves)
        report_failures(checkpointer, progress)
        batches = micro_batches(dataset, consumed_samples, args.global_batch_size,
                                args.micro_batch_size, dp_rank, dp_size)
        loss = train_step(model, optimizer, batches, args.num_micro_batches, args)
        iteration += 1
        consumed_samples += args.global_batch_size
        progress.update(iteration, loss, checkpointer.in_flight)
        if args.save and iteration % args.save_interval == 0:
            save_checkpoint(checkpointer, iteration, consumed_samples, progress)
            last_saved = iteration
        elif args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
            # As Megatron-LM: a local checkpoint only where no persistent one is saved.
            save_checkpoint(checkpointer, iteration, consumed_samples, progress, local=True)
        if iteration == crash_after:
            report_saves(checkpointer.maybe_finalize(blocking=True), progress, saves)
            progress.event(f"[debug] iter {iteration}: every rank exits now, as if the job "
                           f"were lost ({DEBUG_CRASH_AFTER_ENV})")
            dist.barrier()
            os._exit(1)

    # Save the final state if the interval did not, then wait for every save.
    if args.save and iteration != last_saved:
        save_checkpoint(checkpointer, iteration, consumed_samples, progress)
    report_saves(checkpointer.close(), progress, saves)
    report_failures(checkpointer, progress)
    summary = f"done: {iteration} iterations in {time.perf_counter() - start:.1f} s"
    if saves:
        summary += (
            f"; {len(saves)} checkpoint(s) stalled training for "
            f"{sum(r.stall_s for r in saves):.3f} s in total, "
            f"{sum(r.background_s for r in saves):.3f} s of writing ran in the background"
        )
    progress.event(summary)
    progress.close()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
