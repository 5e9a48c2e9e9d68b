"""Command-line flags of examples/pretrain_gpt.py, named as in Megatron-LM."""

from __future__ import annotations

import argparse
import os
import warnings
from typing import List, Optional

from megatron_async.storage import is_object_url
from megatron_async.storage.client import MSC_EXTRA_HINT, msc_available

__all__ = ["parse_args", "validate_parallel_args"]


_SIZE_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _staging_limit(text: str):
    """``--ckpt-staging-memory-limit``: bytes (``512M``, ``4G``, ``1000000``) or a fraction (``0.1``)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if value and value[-1] in _SIZE_SUFFIXES:
            return int(float(value[:-1]) * _SIZE_SUFFIXES[value[-1]])
        if "." in value:
            return float(value)
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give bytes (e.g. 512M, 4G) or a fraction of the node's memory (e.g. 0.1)"
        ) from None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Pretrain a small GPT with megatron-core and save torch_dist checkpoints "
        "with megatron_async. Launch with torchrun --nproc-per-node N.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--hidden-size", type=int, default=64)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--seq-length", type=int, default=32)
    model.add_argument("--vocab-size", type=int, default=256,
                       help="synthetic data only; --data-path always uses the 256 byte values")
    model.add_argument("--hidden-dropout", type=float, default=0.1)
    model.add_argument("--attention-dropout", type=float, default=0.1)
    model.add_argument("--transformer-impl", choices=["auto", "local", "transformer_engine"],
                       default="auto",
                       help="auto: transformer_engine when it is installed and CUDA is present")

    train = parser.add_argument_group("training")
    train.add_argument("--train-iters", type=int, required=True)
    train.add_argument("--micro-batch-size", type=int, default=2)
    train.add_argument("--global-batch-size", type=int, default=None,
                       help="default: micro batch size x data-parallel size (no accumulation)")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--data-path", default=None,
                       help="a text file, tokenized at byte level; default: synthetic tokens")
    train.add_argument("--log-interval", type=int, default=1)
    train.add_argument("--metrics-file", default=None,
                       help="rank 0 appends one JSON line per iteration and per save here")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                          help="split the layers evenly over this many stages (1F1B schedule)")
    parallel.add_argument("--use-distributed-optimizer", action="store_true")

    ckpt = parser.add_argument_group("checkpointing")
    ckpt.add_argument("--save", default=None,
                      help="directory to save checkpoints to, or an msc://PROFILE/PREFIX URL "
                      "(object storage through multi-storage-client)")
    ckpt.add_argument("--load", default=None,
                      help="directory (or msc:// URL) to resume from (its tracker)")
    ckpt.add_argument("--msc-config", default=None,
                      help="multi-storage-client configuration that defines the profiles of "
                      "msc:// URLs (sets MSC_CONFIG); default: MSC_CONFIG or ~/.msc_config.yaml")
    ckpt.add_argument("--ckpt-step", type=int, default=None,
                      help="resume from this iteration instead of the tracker's")
    ckpt.add_argument("--save-interval", type=int, default=None)
    ckpt.add_argument("--ckpt-format", choices=["torch_dist"], default="torch_dist")
    ckpt.add_argument("--async-save", action="store_true",
                      help="write checkpoints in the background while training continues")
    ckpt.add_argument("--use-persistent-ckpt-worker", action="store_true",
                      help="one long-lived background process instead of a fork per save")
    ckpt.add_argument("--ckpt-assume-constant-structure", action="store_true",
                      help="reuse the save plan of the first save for later ones")
    ckpt.add_argument("--ckpt-overlap-staging", action="store_true",
                      help="with --async-save: the save returns after planning and the host "
                      "copy runs while the next forward/backward runs (the optimizer step "
                      "waits for it)")
    ckpt.add_argument("--ckpt-staging-memory-limit", type=_staging_limit, default=None,
                      help="the most host (shared) memory one rank's checkpoint staging may "
                      "hold: bytes (an integer, K/M/G suffixes allowed) or a fraction of the "
                      "node's memory shared by its local ranks (e.g. 0.1); a larger state is "
                      "staged and written in rounds. Default: one copy of the state")
    ckpt.add_argument("--ckpt-fully-parallel-save", action="store_true",
                      help="spread replicated shards over the data-parallel ranks")
    ckpt.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                      help="save the distributed optimizer in the model-space format "
                      "(fully_reshardable: gathered over data-parallel ranks at save time) that "
                      "a run with different tensor/pipeline/data parallelism can load; default: "
                      "the bucket format (dp_reshardable), which only a change of the "
                      "data-parallel size can load")
    ckpt.add_argument("--no-save-optim", action="store_true")
    ckpt.add_argument("--no-save-rng", action="store_true")
    ckpt.add_argument("--no-load-optim", action="store_true")
    ckpt.add_argument("--no-load-rng", action="store_true")
    ckpt.add_argument("--ckpt-verify-on-load", action="store_true",
                      help="before loading, re-hash the checkpoint's files (shared among the "
                      "ranks) against the checksums recorded at save time; stop on damage")
    ckpt.add_argument("--keep-last-n", type=int, default=None,
                      help="keep only the newest N checkpoints (never the latest or one in flight)")
    ckpt.add_argument("--ckpt-save-failure", choices=["raise", "continue"], default="raise",
                      help="a failed save ends the job (raise) or is logged on every rank while "
                      "training goes on and the next interval saves again (continue)")
    ckpt.add_argument("--ckpt-max-consecutive-save-failures", type=int, default=3,
                      help="with --ckpt-save-failure continue: this many failed saves in a row "
                      "end the job")

    local = parser.add_argument_group(
        "local checkpoints", "non-persistent checkpoints on node-local storage, replicated to "
        "peer nodes (Megatron-LM's --non-persistent-ckpt-type local)")
    local.add_argument("--non-persistent-save-interval", type=int, default=None,
                       help="save a local checkpoint every N iterations (not at iterations "
                       "that save a persistent one)")
    local.add_argument("--non-persistent-ckpt-type", choices=["global", "local", "in_memory"],
                       default=None, help="only local is implemented here")
    local.add_argument("--non-persistent-local-ckpt-dir", default=None,
                       help="node-local directory of the local checkpoints (one per node)")
    local.add_argument("--non-persistent-local-ckpt-algo", choices=["fully_parallel", "atomic"],
                       default="fully_parallel",
                       help="fully_parallel: each data-parallel rank stores its share of the "
                       "replicated tensors (exchanged again when loading); atomic: each rank "
                       "its whole state")
    local.add_argument("--replication", action="store_true",
                       help="also keep each rank's part on its clique peers")
    local.add_argument("--replication-jump", type=int, default=None,
                       help="rank distance between the members of a clique (typically the "
                       "number of ranks per node)")
    local.add_argument("--replication-factor", type=int, default=2,
                       help="copies of each part, the owner's included")
    return parser


def _check_local_checkpoint_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Megatron-LM's checks of the local checkpoint flags (arguments.py), plus what this
    example does not implement."""
    if args.non_persistent_ckpt_type not in (None, "local"):
        parser.error(f"--non-persistent-ckpt-type {args.non_persistent_ckpt_type} is not "
                     "implemented by this example; use local")
    if args.non_persistent_ckpt_type == "local" and args.non_persistent_local_ckpt_dir is None:
        parser.error("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir")
    if args.non_persistent_save_interval is not None:
        if args.non_persistent_save_interval < 1:
            parser.error("--non-persistent-save-interval must be at least 1")
        if args.non_persistent_ckpt_type is None:
            parser.error("--non-persistent-save-interval needs --non-persistent-ckpt-type local")
        if args.save is None:
            parser.error("--non-persistent-save-interval needs --save (as in Megatron-LM, "
                         "local checkpoints are saved between persistent ones)")
    if args.replication:
        if args.replication_jump is None:
            parser.error("--replication needs --replication-jump")
        if args.non_persistent_ckpt_type != "local":
            parser.error("--replication needs --non-persistent-ckpt-type local")
        if args.replication_jump < 1 or args.replication_factor < 1:
            parser.error("--replication-jump and --replication-factor must be at least 1")
    elif args.replication_jump is not None:
        warnings.warn("--replication-jump was given without --replication: ignored")
        args.replication_jump = None


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and check the flags that do not depend on the world size."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    positive = ["num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                "train_iters", "micro_batch_size", "log_interval", "tensor_model_parallel_size",
                "pipeline_model_parallel_size"]
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.hidden_size % args.num_attention_heads:
        parser.error("--hidden-size must be a multiple of --num-attention-heads")
    if args.data_path is not None:
        args.vocab_size = 256
    if args.save_interval is not None and args.save is None:
        parser.error("--save-interval needs --save")
    if args.save is not None and (args.save_interval is None or args.save_interval < 1):
        parser.error("--save needs --save-interval >= 1")
    if args.use_persistent_ckpt_worker and not args.async_save:
        parser.error("--use-persistent-ckpt-worker only applies with --async-save")
    if args.dist_ckpt_optim_fully_reshardable and not args.use_distributed_optimizer:
        parser.error("--dist-ckpt-optim-fully-reshardable only applies with "
                     "--use-distributed-optimizer")
    if args.keep_last_n is not None and (args.keep_last_n < 1 or args.save is None):
        parser.error("--keep-last-n needs --save and a value of at least 1")
    if args.ckpt_step is not None and args.load is None:
        parser.error("--ckpt-step needs --load")
    if args.ckpt_verify_on_load and args.load is None:
        parser.error("--ckpt-verify-on-load needs --load")
    _check_local_checkpoint_args(parser, args)
    args.object_storage = any(is_object_url(p) for p in (args.save, args.load) if p)
    if args.object_storage and not msc_available():
        parser.error(f"msc:// --save/--load need multi-storage-client: {MSC_EXTRA_HINT}")
    if args.msc_config is not None and not os.path.isfile(args.msc_config):
        parser.error(f"--msc-config {args.msc_config}: no such file")
    return args


def validate_parallel_args(args: argparse.Namespace, world_size: int) -> None:
    """Check the parallel layout against the world size; set ``data_parallel_size`` and
    ``num_micro_batches``. Raises SystemExit with a message, like argparse."""
    tp = args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise SystemExit(f"world size {world_size} is not divisible by "
                         f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}")
    if args.num_attention_heads % tp or args.vocab_size % tp:
        raise SystemExit("--num-attention-heads and the vocabulary size must be multiples of "
                         "--tensor-model-parallel-size")
    if args.num_layers % pp:
        raise SystemExit(f"--num-layers {args.num_layers} must be a multiple of "
                         f"--pipeline-model-parallel-size {pp} (every stage gets as many layers)")
    args.data_parallel_size = world_size // (tp * pp)
    samples_per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = samples_per_step
    if args.global_batch_size % samples_per_step:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                         f"micro batch size x data-parallel size = {samples_per_step}")
    args.num_micro_batches = args.global_batch_size // samples_per_step
    if args.replication:
        group = args.replication_jump * args.replication_factor
        if world_size % group:
            raise SystemExit(f"world size {world_size} is not divisible by --replication-jump "
                             f"{args.replication_jump} x --replication-factor "
                             f"{args.replication_factor} (the ranks form cliques of "
                             f"{args.replication_factor}, {args.replication_jump} ranks apart)")
