"""The GPT example's model, distributed optimizer and data, built as the example builds them.

Shared by the ``gpt`` workload of the stall benchmark, the lost-time training loop and the
save profile. Every rank builds its own :class:`ExampleTrainer`. The example is not an
installed package: its ``gpt`` package is imported from ``examples/`` (the one place that
puts that folder on ``sys.path``, as ``examples/pretrain_gpt.py`` itself finds it).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Sequence

import torch

__all__ = ["ExampleTrainer", "gpt_example_status", "collect_main_replicas"]

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_EXAMPLES_DIR = os.path.join(_REPO_ROOT, "examples")


def _make_example_importable() -> None:
    if _EXAMPLES_DIR not in sys.path:
        sys.path.insert(0, _EXAMPLES_DIR)


def gpt_example_status() -> str:
    """Say whether the GPT example can be imported here (``"ok"`` or why not)."""
    if not os.path.isfile(os.path.join(_EXAMPLES_DIR, "gpt", "model.py")):
        return f"examples/gpt/model.py is missing under {_REPO_ROOT}"
    _make_example_importable()
    try:
        from gpt.model import build_model, build_optimizer  # noqa: F401  (import check)
    except Exception as exc:  # reported in the results instead of the GPT rows
        return f"importing examples/gpt failed: {type(exc).__name__}: {exc}"
    return "ok"


def collect_main_replicas(state_dict: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The main replicas of a sharded state dict, under keys unique to their shard."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    tensors: Dict[str, torch.Tensor] = {}
    for value in nested_values(state_dict):
        if isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
            # A key names a global tensor; its shards (one per layer, for example) differ
            # by offset and, for the distributed optimizer, by flattened range.
            where = ",".join(str(o) for o in value.global_offset)
            if value.flattened_range is not None:
                where += f"@{value.flattened_range.start}"
            tensors[f"{value.key}[{where}]"] = value.data
    return tensors


class ExampleTrainer:
    """The example's model, distributed optimizer and data on this rank (every rank).

    Built in the example's order: flags and process groups here, then (after the
    checkpointing queue, see :meth:`~.methods.base.SaveMethod.start_early`) :meth:`build`.

    Args:
        num_layers: transformer layers.
        hidden_size: hidden size (8 attention heads).
        flags: further flags of ``examples/pretrain_gpt.py`` (``--save``, ``--async-save``...).
    """

    def __init__(self, num_layers: int, hidden_size: int, flags: Sequence[str] = ()):
        _make_example_importable()
        import torch.distributed as dist
        from gpt import cpu_compat, torch_adam_compat
        from gpt.arguments import parse_args, validate_parallel_args
        from megatron.core import parallel_state

        cpu_compat.install()
        torch_adam_compat.install()
        self.args = parse_args([
            "--num-layers", str(num_layers), "--hidden-size", str(hidden_size),
            "--num-attention-heads", "8", "--use-distributed-optimizer", *flags,
        ])
        if self.args.non_persistent_ckpt_type == "local":  # as examples/pretrain_gpt.py does
            from gpt.local_checkpoints import serve_local_checkpointing

            serve_local_checkpointing()
        validate_parallel_args(self.args, dist.get_world_size())
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)

    def build(self) -> None:
        """Build the model, its distributed optimizer and the data."""
        from gpt.data import build_dataset
        from gpt.model import build_model, build_optimizer, resolve_transformer_impl, set_seed

        self.args.transformer_impl = resolve_transformer_impl("auto")
        set_seed(self.args.seed)
        self.model = build_model(self.args)
        self.optimizer = build_optimizer(self.args, self.model)
        self.dataset = build_dataset(self.args)
        self.consumed = 0
        self.iteration = 0

    def step(self) -> None:
        """One training step of the example (forward, backward, optimizer step)."""
        from gpt.data import micro_batches
        from gpt.model import train_step
        from megatron.core import parallel_state

        args = self.args
        batches = micro_batches(self.dataset, self.consumed, args.global_batch_size,
                                args.micro_batch_size, parallel_state.get_data_parallel_rank(),
                                parallel_state.get_data_parallel_world_size())
        train_step(self.model, self.optimizer, batches, args.num_micro_batches, args)
        self.consumed += args.global_batch_size
        self.iteration += 1

    def sharded_state_dict(self) -> Dict[str, Any]:
        """The model's and the optimizer's sharded state dicts, as the example saves them."""
        model_sd = self.model.module.sharded_state_dict()
        optimizer_sd = self.optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        return {"model": model_sd, "optimizer": optimizer_sd}

    def dcp_state_dict(self) -> Dict[str, torch.Tensor]:
        """This rank's saved tensors (main replicas), under keys unique to this rank.

        Rebuilt per call like the sharded state dict: the optimizer may build new tensors.
        """
        import torch.distributed as dist

        rank = dist.get_rank()
        # Detached, as ``module.state_dict()`` hands them to DCP: DCP's stager (torch 2.11,
        # CUDA tensors) cannot deep-copy an ``nn.Parameter`` (KeyError: <class 'type'>).
        return {f"rank{rank}/{key}": tensor.detach()
                for key, tensor in collect_main_replicas(self.sharded_state_dict()).items()}
