"""The data every save method writes, built on every rank.

Two workloads:

* ``synthetic``: ``tensor_count`` 1-D shards per rank with the same total bytes whatever
  the count (from ~100 large tensors to ~20,000 small ones). Tensor ``i`` is a global
  tensor ``synthetic.t{i}`` split along dim 0 over the ranks
  (``ShardedTensor.from_rank_offsets``), so every rank owns distinct data and every rank
  writes.
* ``gpt``: the model and optimizer of ``examples/pretrain_gpt.py`` (megatron-core GPT,
  Adam with the distributed optimizer, so optimizer shards differ per rank), after one
  training step so that the optimizer state exists.

Both give megatron-core a sharded state dict, rebuilt for every save as a training loop
would, and PyTorch DCP the same tensors under per-rank keys (``rank{r}/...``), so each
rank writes its own data there too and DCP's deduplication has nothing to remove.
"""

from __future__ import annotations

import abc
import argparse
import os
import sys
from typing import Any, Dict, List

import torch

__all__ = ["Workload", "SyntheticWorkload", "GptWorkload", "build_workload", "gpt_example_status"]

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_EXAMPLES_DIR = os.path.join(_REPO_ROOT, "examples")


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Workload(abc.ABC):
    """What one rank saves: a megatron-core sharded state dict and its DCP counterpart."""

    name: str

    @abc.abstractmethod
    def sharded_state_dict(self, iteration: int) -> Dict[str, Any]:
        """Build this rank's sharded state dict for a save (every rank, training thread)."""

    @abc.abstractmethod
    def dcp_state_dict(self) -> Dict[str, torch.Tensor]:
        """The same tensors as a flat dict with keys unique to this rank."""

    @abc.abstractmethod
    def train_step(self) -> None:
        """Change the saved tensors in place, as a training step would."""

    @property
    @abc.abstractmethod
    def num_bytes(self) -> int:
        """Payload this rank writes (main replicas only)."""

    @property
    @abc.abstractmethod
    def tensor_count(self) -> int:
        """Tensors this rank writes."""


class SyntheticWorkload(Workload):
    """``tensor_count`` random shards with ``num_bytes`` in total (see the module docstring)."""

    name = "synthetic"

    def __init__(self, rank: int, world_size: int, num_bytes: int, tensor_count: int, dtype: str):
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
            raise ValueError(f"--dtype must name a floating-point torch dtype, got {dtype!r}")
        element_size = torch.empty((), dtype=torch_dtype).element_size()
        numel = num_bytes // element_size
        if numel < tensor_count:
            raise ValueError(
                f"{num_bytes} bytes per rank cannot hold {tensor_count} {dtype} tensors; "
                "raise --bytes-per-rank or lower --tensor-counts"
            )
        base, extra = divmod(numel, tensor_count)
        generator = torch.Generator().manual_seed(1234 + rank)
        device = _device()
        self._rank, self._world_size = rank, world_size
        self._tensors: List[torch.Tensor] = [
            torch.rand(base + (i < extra), generator=generator, dtype=torch.float32)
            .to(torch_dtype)
            .to(device)
            for i in range(tensor_count)
        ]

    def sharded_state_dict(self, iteration: int) -> Dict[str, Any]:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        shards = {
            f"t{i}": ShardedTensor.from_rank_offsets(
                f"synthetic.t{i}", tensor, (0, self._rank, self._world_size)
            )
            for i, tensor in enumerate(self._tensors)
        }
        return {"iteration": iteration, "synthetic": shards}

    def dcp_state_dict(self) -> Dict[str, torch.Tensor]:
        return {f"rank{self._rank}/t{i}": t for i, t in enumerate(self._tensors)}

    def train_step(self) -> None:
        torch._foreach_add_(self._tensors, 1.0)
        if self._tensors[0].is_cuda:
            torch.cuda.synchronize()  # time the update itself, not its launch

    @property
    def num_bytes(self) -> int:
        return sum(_num_bytes(t) for t in self._tensors)

    @property
    def tensor_count(self) -> int:
        return len(self._tensors)


def gpt_example_status() -> str:
    """Say whether the GPT example can be imported here (``"ok"`` or why not)."""
    if not os.path.isfile(os.path.join(_EXAMPLES_DIR, "gpt", "model.py")):
        return f"examples/gpt/model.py is missing under {_REPO_ROOT}"
    if _EXAMPLES_DIR not in sys.path:
        sys.path.insert(0, _EXAMPLES_DIR)
    try:
        from gpt.model import build_model, build_optimizer  # noqa: F401  (import check)
    except Exception as exc:  # reported in the results instead of the GPT rows
        return f"importing examples/gpt failed: {type(exc).__name__}: {exc}"
    return "ok"


class GptWorkload(Workload):
    """The GPT example's model and distributed optimizer, after one training step.

    Builds them exactly as ``examples/pretrain_gpt.py`` does (its flags, its
    ``build_model``/``build_optimizer``/``train_step``); on a CPU-only host that includes
    the example's ``cpu_compat`` patches, which stay active in this rank process.
    """

    name = "gpt"

    def __init__(self, num_layers: int, hidden_size: int):
        status = gpt_example_status()
        if status != "ok":
            raise RuntimeError(f"the GPT workload needs the example: {status}")
        import torch.distributed as dist
        from gpt import cpu_compat
        from gpt.arguments import parse_args, validate_parallel_args
        from gpt.data import build_dataset, micro_batches
        from gpt.model import build_model, build_optimizer, resolve_transformer_impl, set_seed
        from megatron.core import parallel_state

        cpu_compat.install()
        args: argparse.Namespace = parse_args(
            [
                "--train-iters", "1",
                "--num-layers", str(num_layers),
                "--hidden-size", str(hidden_size),
                "--num-attention-heads", "8",
                "--use-distributed-optimizer",
            ]
        )
        validate_parallel_args(args, dist.get_world_size())
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        args.transformer_impl = resolve_transformer_impl("auto")
        set_seed(args.seed)
        self._args = args
        self._model = build_model(args)
        self._optimizer = build_optimizer(args, self._model)
        self._dataset = build_dataset(args)
        self._micro_batches = micro_batches
        self._consumed = 0
        self.train_step()  # creates the Adam state
        self._rank = dist.get_rank()
        self._main_tensors = self._collect_main_replicas(self.sharded_state_dict(0))

    def sharded_state_dict(self, iteration: int) -> Dict[str, Any]:
        model_sd = self._model.module.sharded_state_dict()
        optimizer_sd = self._optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )
        return {"iteration": iteration, "model": model_sd, "optimizer": optimizer_sd}

    @staticmethod
    def _collect_main_replicas(state_dict: Dict[str, Any]) -> Dict[str, torch.Tensor]:
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

    def dcp_state_dict(self) -> Dict[str, torch.Tensor]:
        # Refreshed like the megatron-core state dict: the optimizer may build new tensors.
        tensors = self._collect_main_replicas(self.sharded_state_dict(0))
        return {f"rank{self._rank}/{key}": t for key, t in tensors.items()}

    def train_step(self) -> None:
        from gpt.model import train_step
        from megatron.core import parallel_state

        args = self._args
        batches = self._micro_batches(
            self._dataset,
            self._consumed,
            args.global_batch_size,
            args.micro_batch_size,
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
        )
        train_step(self._model, self._optimizer, batches, args.num_micro_batches, args)
        self._consumed += args.global_batch_size

    @property
    def num_bytes(self) -> int:
        return sum(_num_bytes(t) for t in self._main_tensors.values())

    @property
    def tensor_count(self) -> int:
        return len(self._main_tensors)


def build_workload(payload: Dict[str, Any], rank: int, world_size: int) -> Workload:
    """Build the workload a launch's payload names (every rank)."""
    if payload["workload"] == "gpt":
        return GptWorkload(payload["gpt_num_layers"], payload["gpt_hidden_size"])
    return SyntheticWorkload(
        rank, world_size, payload["bytes_per_rank"], payload["tensor_count"], payload["dtype"]
    )
