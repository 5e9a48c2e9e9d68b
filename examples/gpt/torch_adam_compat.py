"""megatron-core's distributed optimizer over torch's Adam (no Transformer Engine, no Apex).

Without Transformer Engine or Apex (always on a CPU-only host, and on a GPU host that
lacks both) megatron-core falls back to torch's Adam, which keeps ``step`` in each
parameter's state, where megatron-core's distributed optimizer does not expect it. Its
checkpoint load then goes wrong in three places, on CPU and GPU alike; the GPU path was
first run on an H200, where the ``fully_reshardable`` resume raised ``KeyError: 'step'``.
One patch and two functions, called around the load by ``training_state.py``, cover it;
each acts only when megatron-core uses torch's Adam:

1. :func:`prepare_optimizer_for_load`: ``DistributedOptimizer.state_dict()`` (needed to
   build the load template) reads ``step`` from the per-parameter state, which torch's
   Adam creates only at its first step, so it fails on a fresh optimizer. A step with
   zero gradients and learning rate 0 creates the state without changing a parameter.
2. :func:`repair_optimizer_after_load`: the ``dp_reshardable`` load restores ``step`` from
   the checkpoint's param groups and then overwrites it with the *template's* value (a
   non-persistent entry of the parameter state), and both formats hand one shared
   ``step`` tensor to every parameter, which torch's Adam then increments once per
   parameter and step. Either way a resumed run's bias correction would differ from the
   uninterrupted run's. Each parameter gets its own ``step`` again, from the checkpoint.
3. **``DistributedOptimizer._set_main_param_and_optimizer_states``** (patched by
   :func:`install`): the ``fully_reshardable`` load (``--dist-ckpt-optim-fully-reshardable``)
   skips ``step`` when it collects a parameter's saved tensors, then copies into *every*
   entry of the parameter's state, ``step`` included, and fails with ``KeyError: 'step'``.
   The patch copies only what was loaded and leaves ``step`` to item 2.

Every rank, training thread. None of this is used by the ``megatron_async`` library.
"""

from __future__ import annotations

from typing import List

import torch

__all__ = ["install", "prepare_optimizer_for_load", "repair_optimizer_after_load"]

_installed = False


def install() -> bool:
    """Apply item 3 if megatron-core uses torch's Adam; return whether it did. Idempotent."""
    global _installed
    from megatron.core.optimizer import distrib_optimizer

    if _installed:
        return True
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return False
    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def set_states_except_missing_step(self, model_param, tensors):
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if "step" not in state:
            return original(self, model_param, tensors)
        step = state.pop("step")
        try:
            return original(self, model_param, tensors)
        finally:
            state["step"] = step

    cls._set_main_param_and_optimizer_states = set_states_except_missing_step
    _installed = True
    return True


def _torch_adam_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The inner torch optimizers of a megatron-core optimizer, if it fell back to torch's Adam."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    inner = [getattr(opt, "optimizer", None) for opt in chained]
    return [opt for opt in inner if isinstance(opt, torch.optim.Adam)]


def prepare_optimizer_for_load(optimizer) -> None:
    """Create torch Adam's per-parameter state (see the module docstring, item 1).

    Runs on every rank, before the optimizer's sharded state dict is built for loading.
    The loaded checkpoint then overwrites the state.
    """
    for inner in _torch_adam_optimizers(optimizer):
        if inner.state:
            continue
        learning_rates = [group["lr"] for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"] = 0.0
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        inner.step()
        inner.zero_grad(set_to_none=True)
        for group, lr in zip(inner.param_groups, learning_rates):
            group["lr"] = lr


def repair_optimizer_after_load(optimizer, loaded_state_dict) -> None:
    """Give every parameter its own Adam ``step`` with the checkpoint's value (item 2).

    Runs on every rank, right after ``optimizer.load_state_dict(loaded_state_dict)``.

    Args:
        optimizer: the megatron-core optimizer that was loaded.
        loaded_state_dict: what it was loaded from (the ``"optimizer"`` entry of the
            state dict returned by ``dist_checkpointing.load``).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not _torch_adam_optimizers(optimizer):
        return
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chained) == 1:
        loaded = [loaded_state_dict]
    elif isinstance(loaded_state_dict, dict):
        loaded = [v for _, v in sorted(loaded_state_dict.items())]
    else:
        loaded = list(loaded_state_dict)
    for megatron_optimizer, state_dict in zip(chained, loaded):
        inner = megatron_optimizer.optimizer
        if not isinstance(inner, torch.optim.Adam):
            continue
        if isinstance(megatron_optimizer, DistributedOptimizer):
            saved_groups = state_dict["optimizer"]["param_groups"]
            for group, saved in zip(inner.param_groups, saved_groups):
                for param in group["params"]:
                    inner.state[param]["step"] = torch.tensor(float(saved["step"]))
        else:
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()
