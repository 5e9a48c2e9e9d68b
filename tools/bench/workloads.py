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
from typing import Any, Dict, List

import torch

from .gpt_example import ExampleTrainer, collect_main_replicas, gpt_example_status

__all__ = ["Workload", "SyntheticWorkload", "GptWorkload", "build_workload", "gpt_example_status"]


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


class GptWorkload(Workload):
    """The GPT example's model and distributed optimizer, after one training step.

    Builds them exactly as ``examples/pretrain_gpt.py`` does (see
    :class:`~.gpt_example.ExampleTrainer`); on a CPU-only host that includes the example's
    ``cpu_compat`` patches, which stay active in this rank process.
    """

    name = "gpt"

    def __init__(self, num_layers: int, hidden_size: int):
        status = gpt_example_status()
        if status != "ok":
            raise RuntimeError(f"the GPT workload needs the example: {status}")
        self._trainer = ExampleTrainer(num_layers, hidden_size, ["--train-iters", "1"])
        self._trainer.build()
        self.train_step()  # creates the Adam state
        self._main_tensors = collect_main_replicas(self._trainer.sharded_state_dict())

    def sharded_state_dict(self, iteration: int) -> Dict[str, Any]:
        return {"iteration": iteration, **self._trainer.sharded_state_dict()}

    def dcp_state_dict(self) -> Dict[str, torch.Tensor]:
        return self._trainer.dcp_state_dict()

    def train_step(self) -> None:
        self._trainer.step()

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
