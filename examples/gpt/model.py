"""Model, optimizer and one training step, all from megatron-core.

Every function here runs on every rank.
"""

from __future__ import annotations

import importlib.util
import random
from typing import Iterable, Tuple

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["build_model", "build_optimizer", "resolve_transformer_impl", "set_seed", "train_step"]


def resolve_transformer_impl(requested: str) -> str:
    """Pick the layer implementation: Transformer Engine only with CUDA and TE installed."""
    te_usable = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine")
    if requested == "auto":
        return "transformer_engine" if te_usable else "local"
    if requested == "transformer_engine" and not te_usable:
        raise SystemExit("--transformer-impl transformer_engine needs CUDA and transformer_engine")
    return requested


def set_seed(seed: int) -> None:
    """Seed every generator; tensor-parallel ranks get distinct model-parallel streams."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build_model(args) -> DistributedDataParallel:
    """Build the GPT model (weights initialized on the CPU) and wrap it in megatron-core DDP.

    Initializing on the CPU gives the same weights for every tensor-parallel size and on
    every device, which keeps runs comparable.
    """
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    if args.transformer_impl == "transformer_engine":
        layer_spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = get_gpt_layer_local_spec()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        position_embedding_type="learned_absolute",
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=False,
    )
    return DistributedDataParallel(config, ddp_config, model)


def build_optimizer(args, model: DistributedDataParallel):
    """Adam through ``get_megatron_optimizer``: plain, or sharded over data-parallel ranks."""
    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, [model])


def train_step(
    model: DistributedDataParallel,
    optimizer,
    micro_batches: Iterable[Tuple[torch.Tensor, torch.Tensor]],
    num_micro_batches: int,
) -> float:
    """Run forward/backward over the micro batches, reduce gradients, step the optimizer.

    Returns:
        The mean loss of the global batch (averaged over micro batches and data-parallel
        ranks), the same on every rank.
    """
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    model.zero_grad_buffer()
    optimizer.zero_grad()
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tokens, labels in micro_batches:
        tokens, labels = tokens.to(device), labels.to(device)
        position_ids = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        per_token_loss = model(tokens, position_ids, None, labels=labels)
        loss = per_token_loss.float().mean()
        (loss / num_micro_batches).backward()
        total += loss.detach()
    model.finish_grad_sync()
    update_ok, _, _ = optimizer.step()
    if not update_ok:
        raise RuntimeError("the optimizer skipped its step (non-finite gradients)")
    total /= num_micro_batches
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total / parallel_state.get_data_parallel_world_size()).item()
