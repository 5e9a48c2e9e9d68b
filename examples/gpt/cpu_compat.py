"""Run megatron-core training code (0.16.x to 0.19.x) on a CPU-only host (gloo, no CUDA).

Everything in this example that exists only because megatron-core assumes CUDA (and
Transformer Engine or Apex) lives here or in :mod:`gpt.torch_adam_compat`, so that it is easy to see, review and delete once
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

Without Transformer Engine or Apex megatron-core falls back to torch's Adam, whose
``step`` its distributed optimizer mishandles on load: that is not CPU-specific and
lives in :mod:`gpt.torch_adam_compat`, active on CPU and GPU hosts alike.

None of this is used by the ``megatron_async`` library, which supports CPU hosts on its
own.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, Optional

import torch
from megatron.core.tensor_parallel import random as tp_random
from torch.overrides import TorchFunctionMode

__all__ = [
    "CpuRNGStatesTracker",
    "install",
    "is_installed",
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
