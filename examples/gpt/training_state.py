"""The training state a checkpoint holds, shared by the persistent and the local tier.

Model and optimizer as megatron-core sharded tensors, each rank's RNG states as a
:class:`ShardedObject`, and plain values (iteration, data position, what the
checkpoint contains and the parallel layout that saved it) that megatron-core keeps in
the common part. :class:`TrainingState` builds that sharded state dict and applies a
loaded one; every method runs on every rank, in the training thread.
"""

from __future__ import annotations

import random
from typing import Any, Dict, Optional

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from gpt import torch_adam_compat
from gpt.resharding import ParallelLayout, with_process_groups

__all__ = ["CHECKPOINT_VERSION", "TrainingState"]

CHECKPOINT_VERSION = 2
"""2: RNG states are sharded over (pipeline, tensor, data) ranks; 1 had no pipeline axis."""


class TrainingState:
    """Model, optimizer, RNG states and data position, as one sharded state dict.

    Args:
        model: the megatron-core DDP-wrapped model.
        optimizer: the megatron-core optimizer of ``model``.
    """

    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer

    def sharded_state_dict(
        self,
        iteration: int,
        consumed_samples: int,
        metadata: Dict[str, Any],
        *,
        is_loading: bool,
        with_optimizer: bool,
        with_rng: bool,
    ) -> Dict[str, Any]:
        """The sharded state dict to save, or the template to load into (every rank).

        ``metadata`` is the format (this run's to save, the checkpoint's to load). Both
        tiers save this dict: the persistent one through ``dist_checkpointing.save``,
        the local one as megatron-core's ``MCoreTensorAwareStateDict``.
        """
        metadata = with_process_groups(metadata)
        model_sd = self.model.module.sharded_state_dict(metadata=metadata)
        content = {
            "optimizer": with_optimizer,
            "rng": with_rng,
            "layout": ParallelLayout.current().as_dict(),
        }
        state_dict: Dict[str, Any] = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "content": content,
            "model": model_sd,
        }
        if with_optimizer:
            state_dict["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=metadata
            )
        if with_rng:
            state_dict["rng_state"] = _rng_sharded_object(
                None if is_loading else _collect_rng_state()
            )
        return state_dict


    def prepare_load(self, with_optimizer: bool) -> None:
        """Get the optimizer ready to be loaded into (before its template is built)."""
        if with_optimizer:
            torch_adam_compat.prepare_optimizer_for_load(self.optimizer)

    def apply(self, state_dict: Dict[str, Any], *, with_optimizer: bool, with_rng: bool) -> None:
        """Load a loaded state dict (the template of :meth:`sharded_state_dict`, filled)
        into the model, the optimizer and the RNGs."""
        # no_grad: with fp32 parameters the distributed optimizer's main parameters are
        # views of the model's leaf parameters, and it loads into them with copy_().
        with torch.no_grad():
            self.model.module.load_state_dict(state_dict["model"])
            if with_optimizer:
                self.optimizer.load_state_dict(state_dict["optimizer"])
                torch_adam_compat.repair_optimizer_after_load(self.optimizer, state_dict["optimizer"])
        if with_rng:
            _restore_rng_state(state_dict["rng_state"])


def _collect_rng_state() -> Dict[str, Any]:
    """Every RNG the training loop draws from on this rank."""
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "tracker": {name: s.clone() for name, s in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state: Optional[Dict[str, Any]]) -> ShardedObject:
    """One RNG record per (pipeline, tensor-parallel, data-parallel) rank; no replicas."""
    return ShardedObject(
        "rng_state",
        state,
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size(),
        ),
        (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(),
        ),
        replica_id=0,
    )
