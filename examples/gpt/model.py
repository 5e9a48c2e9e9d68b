"""Model, optimizer and one training step, all from megatron-core.

Every function here runs on every rank. With pipeline parallelism each rank builds the
layers of its own stage (the first stage also the embeddings, the last stage also the
final norm and output layer) and :func:`train_step` runs megatron-core's pipeline
schedule, which moves activations and their gradients between stages with point-to-point
sends and receives.
"""

from __future__ import annotations

import importlib.util
import random
from functools import partial
from typing import Iterable, Tuple

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
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
    """Build this rank's pipeline stage of the GPT model and wrap it in megatron-core DDP.

    Initializing on the CPU gives the same weights for every tensor-parallel size and on
    every device, which keeps runs comparable (a pipeline stage draws only its own layers,
    so its weights differ from those of an unsplit model with the same seed).
    """
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        # The dtype of the activations sent between stages.
        pipeline_dtype=torch.float32,
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
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=False,
    )
    ddp_model = DistributedDataParallel(config, ddp_config, model)
    # What the pipeline schedules call: gradients are reduced once, after the last micro
    # batch (no_sync before), by finalize_model_grads (data-parallel reduction, then the
    # reductions that span pipeline stages).
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp_model


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


def _loss(labels_loss: torch.Tensor):
    """Last stage: the mean per-token loss of one micro batch, and a copy of it to log.

    A copy, because the schedule scales the returned loss in place (by the number of
    micro batches) before its backward pass.
    """
    loss = labels_loss.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model, device):
    """One micro batch through this rank's stage (the schedule feeds other stages' inputs)."""
    tokens, labels = next(data_iterator)
    tokens, labels = tokens.to(device), labels.to(device)
    position_ids = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    # The first stage embeds the tokens; only the last stage computes the loss from labels.
    output = model(tokens, position_ids, None, labels=labels)
    return output, _loss


def train_step(
    model: DistributedDataParallel,
    optimizer,
    micro_batches: Iterable[Tuple[torch.Tensor, torch.Tensor]],
    num_micro_batches: int,
    args,
) -> float:
    """Run forward/backward over the micro batches, reduce gradients, step the optimizer.

    Every stage of the pipeline reads the same micro batches: the first uses the tokens,
    the last the labels. megatron-core's schedule (no pipelining, or 1F1B across stages)
    divides each micro batch's loss by ``num_micro_batches`` before its backward pass.

    Returns:
        The mean loss of the global batch (averaged over micro batches and data-parallel
        ranks), computed on the last pipeline stage and broadcast to the others, so that it
        is the same on every rank.
    """
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    model.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=partial(_forward_step, device=device),
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=num_micro_batches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    update_ok, _, _ = optimizer.step()
    if not update_ok:
        raise RuntimeError("the optimizer skipped its step (non-finite gradients)")
    total = torch.zeros((), dtype=torch.float32, device=device)
    if parallel_state.is_pipeline_last_stage():
        for micro_batch in losses:
            total += micro_batch["lm loss"]
        total /= num_micro_batches
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
        total /= parallel_state.get_data_parallel_world_size()
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(
            total,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return total.item()
