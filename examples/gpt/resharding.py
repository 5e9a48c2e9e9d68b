"""Which parallelism a checkpoint can be resumed with, decided before anything is loaded.

megatron-core's ``torch_dist`` checkpoints store the model in *model space*: every
parameter is one global tensor, cut into shards by whatever tensor- (TP), pipeline- (PP)
and data-parallel (DP) layout saved it, so any layout can load it. The optimizer state
follows the model, except for the distributed optimizer in its default format:

* ``dp_reshardable`` (the default, as in Megatron-LM): each data-parallel group writes its
  gradient buffers' buckets as they are in memory. Fast and without communication, but the
  bucket layout depends on the tensor- and pipeline-parallel split, so only the
  data-parallel size may change on resume; a different TP or PP fails deep inside
  megatron-core's load with ``Global shape mismatch ... bucket_idx_0``.
* ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): at save time the
  shards are gathered over the data-parallel ranks and written in model space like a
  plain optimizer's state; any layout can load it.

A save records its format the way Megatron-LM does: the ``metadata`` that the model and
optimizer ``sharded_state_dict`` calls receive is stored in the checkpoint as its
*content metadata* (``dist_checkpointing.save(..., content_metadata=...)``), and a load
reads it back (``dist_checkpointing.load_content_metadata``) to build a template of the
same format. :func:`check_optimizer_resume` compares that format and the saved layout
with this run's before loading, and stops with the flag to use when megatron-core cannot
reshard. Every function here runs on every rank and agrees across ranks (all inputs are
the same everywhere).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

from megatron.core import parallel_state
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

__all__ = [
    "LEGACY_DISTRIBUTED_OPTIMIZER_METADATA",
    "ParallelLayout",
    "build_content_metadata",
    "check_optimizer_resume",
    "with_process_groups",
]

_SHARDING_TYPE_KEY = "distrib_optim_sharding_type"

LEGACY_DISTRIBUTED_OPTIMIZER_METADATA = {_SHARDING_TYPE_KEY: "dp_reshardable"}
"""Content metadata assumed for this example's checkpoints written before it stored any:
they always saved the distributed optimizer as ``dp_reshardable``."""


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The parallel sizes of a run, or of the run that saved a checkpoint."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int

    @classmethod
    def current(cls) -> "ParallelLayout":
        """This run's layout, from megatron-core's initialized ``parallel_state``."""
        return cls(
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            data_parallel_size=parallel_state.get_data_parallel_world_size(),
        )

    @classmethod
    def from_dict(cls, saved: Mapping[str, int]) -> "ParallelLayout":
        """The layout recorded in a checkpoint; checkpoints from before pipeline
        parallelism have no pipeline size, which was 1."""
        return cls(
            tensor_model_parallel_size=saved["tensor_model_parallel_size"],
            pipeline_model_parallel_size=saved.get("pipeline_model_parallel_size", 1),
            data_parallel_size=saved["data_parallel_size"],
        )

    def as_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return (f"TP={self.tensor_model_parallel_size} PP={self.pipeline_model_parallel_size} "
                f"DP={self.data_parallel_size}")


def build_content_metadata(args) -> Dict[str, Any]:
    """The ``sharded_state_dict`` metadata of a save, as Megatron-LM builds it.

    It is passed to the model's and the optimizer's ``sharded_state_dict`` and saved as
    the checkpoint's content metadata. It holds no process group, so it can be saved as is
    (see :func:`with_process_groups` for the calls).
    """
    metadata: Dict[str, Any] = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }
    if args.use_distributed_optimizer and args.dist_ckpt_optim_fully_reshardable:
        metadata[_SHARDING_TYPE_KEY] = "fully_reshardable"
        # Gather over the data-parallel group with its own backend (not the gloo copy that
        # returns the state on DP rank 0 only); the saved tensors are the same either way.
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    elif args.use_distributed_optimizer:
        metadata[_SHARDING_TYPE_KEY] = "dp_reshardable"
    return metadata


def with_process_groups(metadata: Mapping[str, Any]) -> Dict[str, Any]:
    """``metadata`` plus the data-parallel group megatron-core's modules read from it
    (never saved: a process group only exists in this run)."""
    return {
        **metadata,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }


def _optimizer_kind(distributed: bool) -> str:
    return "distributed" if distributed else "plain (non-distributed)"


def check_optimizer_resume(
    path: str,
    content_metadata: Optional[Mapping[str, Any]],
    saved_layout: ParallelLayout,
    layout: ParallelLayout,
    use_distributed_optimizer: bool,
) -> None:
    """Stop before loading when megatron-core cannot load the saved optimizer state here.

    Runs on every rank, before the load template is built; every rank decides the same.

    Args:
        path: the checkpoint directory (for the message).
        content_metadata: the checkpoint's content metadata (with the legacy default
            filled in for checkpoints that have none).
        saved_layout: the layout that saved the checkpoint.
        layout: this run's layout.
        use_distributed_optimizer: whether this run uses the distributed optimizer.

    Raises:
        SystemExit: with a message naming the flags that make the resume possible.
    """
    sharding_type = (content_metadata or {}).get(_SHARDING_TYPE_KEY)
    saved_distributed = sharding_type is not None
    if saved_distributed != use_distributed_optimizer:
        raise SystemExit(
            f"{path} holds the state of the {_optimizer_kind(saved_distributed)} optimizer "
            f"and this run uses the {_optimizer_kind(use_distributed_optimizer)} one; "
            "megatron-core cannot convert one into the other. Resume with the optimizer it was "
            "saved with (--use-distributed-optimizer or not), or pass --no-load-optim to "
            "resume the model with a fresh optimizer."
        )
    if not saved_distributed:
        return  # the plain optimizer's state is in model space: any layout loads it
    if sharding_type in DistributedOptimizer.checkpoint_fully_reshardable_formats:
        return
    changed = [
        f"{name} {getattr(saved_layout, attr)} -> {getattr(layout, attr)}"
        for name, attr in (
            ("tensor-parallel size", "tensor_model_parallel_size"),
            ("pipeline-parallel size", "pipeline_model_parallel_size"),
        )
        if getattr(saved_layout, attr) != getattr(layout, attr)
    ]
    if changed:
        raise SystemExit(
            f"{path} holds the distributed optimizer in the {sharding_type!r} format (its "
            f"gradient-buffer buckets as laid out by {saved_layout}), which megatron-core "
            f"can load only with the same tensor- and pipeline-parallel sizes; this run "
            f"changes the {', '.join(changed)} ({layout}). Either pass --no-load-optim to "
            "resume the model with a fresh optimizer, or resume once with the layout it was "
            "saved with and save with --dist-ckpt-optim-fully-reshardable, whose checkpoints "
            "any parallel layout can load."
        )
