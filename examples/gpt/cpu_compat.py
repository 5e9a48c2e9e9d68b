"""Run megatron-core training code (0.16.x to 0.19.x) on a CPU-only host (gloo, no CUDA).

Everything in this example that exists only because megatron-core assumes CUDA (and
Transformer Engine or Apex) lives here, so that it is easy to see, review and delete once
megatron-core stops assuming it. Loading a ``torch_dist`` checkpoint with megatron-core's
default load strategy needs nothing beyond the items below.
:func:`install` is a no-op when CUDA is available; on a CPU-only host it makes these
changes, for this process only:

1. **RNG tracker.** ``tensor_parallel.random.CudaRNGStatesTracker`` seeds, saves and
   restores the *CUDA* generator (``torch.cuda.get_rng_state``), which a CPU build of
   torch does not have. Dropout inside tensor-parallel regions forks the tracker on every
   forward step, and ``model_parallel_cuda_manual_seed`` fills it. We install
   :class:`CpuRNGStatesTracker`, which keeps the same named states for the CPU default
   generator, so the unchanged megatron-core calls work and their states can be saved in
   checkpoints like the CUDA ones.
2. **``torch.cuda.current_device``** returns ``"cpu"``. DDP grad buffers, the distributed
   optimizer's shards and tensor-parallel all-gathers allocate with
   ``device=torch.cuda.current_device()``.
3. **``torch.cuda.synchronize``** becomes a no-op (it raises on a CPU build); DDP, the
   fully parallel save wrapper and the pipeline schedules' point-to-point exchange
   (``P2PCommunicator``, after every batch of sends and receives) call it. CPU work and
   waited-on gloo requests are synchronous, so nothing is lost.
   **``torch.cuda.current_stream``** likewise returns a :class:`_HostStream` whose waits
   and synchronizations return at once: megatron-core 0.19's DDP grad-sync asks the
   current stream to wait for CUDA-graph events before every gradient reduction.
4. **A torch function mode** (:class:`_CudaToCpuMode`) entered for the life of the main
   thread maps CUDA devices to the CPU: ``device="cuda"`` arguments of factory functions
   (the optimizers' ``torch.tensor([1.0], device='cuda')``, ``clip_grads``' buffers),
   ``Tensor.cuda()`` and ``Tensor.to("cuda")``. It also reports fp32/fp16/bf16 CPU
   tensors under their CUDA type names from ``Tensor.type()``, because the (distributed)
   optimizer and ``clip_grads`` accept parameters only when
   ``param.type() == 'torch.cuda.FloatTensor'``. Only the main thread runs megatron-core
   code, so other threads (background checkpoint writers) never see the mode.
   The pipeline schedules need nothing more: they count tokens in
   ``torch.zeros(..., device="cuda")`` and ``P2PCommunicator`` allocates its receive
   buffers with ``device=torch.cuda.current_device()`` (items 2 and 4), and
   ``torch.distributed.batch_isend_irecv`` sends CPU tensors over gloo one by one, since
   gloo cannot coalesce.

Without Transformer Engine or Apex (always the case on a CPU-only host) megatron-core
falls back to torch's Adam, and its *distributed optimizer* then mishandles Adam's
``step`` when loading a checkpoint. One patch and two functions, called around the load
by ``checkpointing.py``, cover that; they act only when megatron-core uses torch's Adam:

5. :func:`prepare_optimizer_for_load`: ``DistributedOptimizer.state_dict()`` (needed to
   build the load template) reads ``step`` from the per-parameter state, which torch's
   Adam creates only at its first step, so it fails on a fresh optimizer. A step with
   zero gradients and learning rate 0 creates the state without changing a parameter.
6. :func:`repair_optimizer_after_load`: torch's Adam keeps ``step`` in each parameter's
   state, where megatron-core's distributed optimizer does not expect it. Its
   ``dp_reshardable`` load restores ``step`` from the checkpoint's param groups and then
   overwrites it with the *template's* value (a non-persistent entry of the parameter
   state), and both formats hand one shared ``step`` tensor to every parameter, which
   torch's Adam then increments once per parameter and step. Either way a resumed run's
   bias correction differs from the uninterrupted run's. Each parameter gets its own
   ``step`` again, with the value from the checkpoint.
7. **``DistributedOptimizer._set_main_param_and_optimizer_states``** (patched by
   :func:`install`): the ``fully_reshardable`` load
   (``--dist-ckpt-optim-fully-reshardable``) skips ``step`` when it collects a
   parameter's saved tensors, then copies into *every* entry of the parameter's state,
   ``step`` included, and fails with ``KeyError: 'step'``. The patch copies only what was
   loaded and leaves ``step`` to item 6.

None of this is used by the ``megatron_async`` library, which supports CPU hosts on its
own.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Optional

import torch
from megatron.core.tensor_parallel import random as tp_random
from torch.overrides import TorchFunctionMode

__all__ = [
    "CpuRNGStatesTracker",
    "install",
    "is_installed",
    "prepare_optimizer_for_load",
    "repair_optimizer_after_load",
]

logger = logging.getLogger(__name__)

_installed = False


class CpuRNGStatesTracker(tp_random.CudaRNGStatesTracker):
    """Named RNG states of the CPU default generator, with megatron-core's tracker API.

    Runs on every rank, in the training thread. Subclassing megatron-core's tracker keeps
    its bookkeeping (``get_states``/``set_states``/``reset``, ``isinstance`` checks);
    only the methods that touch a generator are replaced.
    """

    def add(self, name: str, seed: int) -> None:
        """Create the state ``name`` as the CPU generator's state after ``seed``."""
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        outer_state = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer_state)

    @contextlib.contextmanager
    def fork(self, name: str = tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from the state ``name`` inside the block; restore the outer state after."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added to the tracker")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


_CUDA_TYPE_NAMES: Dict[str, str] = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Map CUDA device requests to the CPU and report float tensors under CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(args[0])
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_to_cpu_device(kwargs["device"]))
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def is_installed() -> bool:
    """Return True when :func:`install` patched this process."""
    return _installed


def install() -> bool:
    """Make megatron-core's CUDA-only calls work on the CPU, if CUDA is absent.

    Call once per process, on every rank, in the main thread, before megatron-core
    builds anything (``initialize_model_parallel`` may come first). Idempotent.

    Returns:
        True when the patches are active (CPU-only host), False when CUDA is available
        and nothing was changed.
    """
    global _installed
    if _installed:
        return True
    if torch.cuda.is_available():
        return False
    tp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _no_synchronize
    torch.cuda.current_stream = _host_stream
    _patch_distributed_optimizer_state_setter()
    # Entered and never exited: the mode must cover the whole training run.
    _CudaToCpuMode().__enter__()
    _installed = True
    logger.info("CUDA is not available: megatron-core runs on the CPU (see %s)", __name__)
    return True


def _cpu_current_device() -> str:
    return "cpu"


def _no_synchronize(device: Optional[Any] = None) -> None:
    return None


class _HostStream:
    """The "current stream" of a CPU-only host: work is already done when issued."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_HOST_STREAM = _HostStream()


def _host_stream(device: Optional[Any] = None) -> _HostStream:
    return _HOST_STREAM


def _patch_distributed_optimizer_state_setter() -> None:
    """Item 7: make the ``fully_reshardable`` load skip torch Adam's ``step``."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
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


def _torch_adam_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The inner torch optimizers of a megatron-core optimizer, if it fell back to torch's Adam."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    inner = [getattr(opt, "optimizer", None) for opt in chained]
    return [opt for opt in inner if isinstance(opt, torch.optim.Adam)]


def prepare_optimizer_for_load(optimizer) -> None:
    """Create torch Adam's per-parameter state (see the module docstring, item 5).

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
    """Give every parameter its own Adam ``step`` with the checkpoint's value (item 6).

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
