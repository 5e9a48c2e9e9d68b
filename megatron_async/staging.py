"""Host staging: take a snapshot of tensors so the trainer may change them right away.

Runs wherever a request's ``preload_fn`` runs: on the trainer (temporal caller) or in
the persistent worker. The rule this module exists for: every tensor is *copied*.
``tensor.to("cpu")`` returns the very same tensor when it already is on the CPU, so a
checkpoint "staged" that way would pick up every in-place update the optimizer makes
after scheduling.
"""

from __future__ import annotations

from typing import Any, List

import torch

__all__ = ["copy_tensor_to_host", "snapshot_to_host", "synchronize_if_cuda"]


def copy_tensor_to_host(tensor: torch.Tensor, non_blocking: bool = True) -> torch.Tensor:
    """Return a host copy of ``tensor`` that shares no memory with it.

    CUDA tensors go to pinned memory with a non-blocking copy (call
    :func:`synchronize_if_cuda` before reading the result); CPU tensors are cloned
    into compact, contiguous memory.
    """
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        host.copy_(tensor.detach(), non_blocking=non_blocking)
        return host
    if tensor.device.type != "cpu":
        return tensor.detach().to("cpu", copy=True)
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def synchronize_if_cuda(tensors: List[torch.Tensor]) -> None:
    """Wait for pending device-to-host copies from every CUDA device among ``tensors``.

    Each device is synchronized, not just the current one: a copy from another device
    runs on that device's stream.
    """
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)


def snapshot_to_host(obj: Any) -> Any:
    """Copy every tensor in a nested dict/list/tuple structure to host memory.

    Containers are rebuilt with their own type (dict subclasses such as OrderedDict
    included); other leaves are returned as they are, since the caller snapshots them
    anyway (a fork or a pickle happens before the trainer continues).
    """
    copied: List[torch.Tensor] = []
    cuda_sources: List[torch.Tensor] = []

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type == "cuda":
                cuda_sources.append(value)
            host = copy_tensor_to_host(value)
            copied.append(host)
            return host
        if isinstance(value, dict):
            rebuilt = type(value)() if type(value) is not dict else {}
            for key, item in value.items():
                rebuilt[key] = visit(item)
            return rebuilt
        if isinstance(value, list):
            return [visit(item) for item in value]
        if isinstance(value, tuple):
            items = [visit(item) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return value

    result = visit(obj)
    synchronize_if_cuda(cuda_sources)
    return result
