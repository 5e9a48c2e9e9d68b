"""Host staging: take a snapshot of tensors so the trainer may change them right away.

Runs wherever a request's ``preload_fn`` runs: on the trainer (temporal caller) or in
the persistent worker. The rule this module exists for: every tensor is *copied*.
``tensor.to("cpu")`` returns the very same tensor when it already is on the CPU, so a
checkpoint "staged" that way would pick up every in-place update the optimizer makes
after scheduling.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch

from megatron_async.core.device_wait import landed_after_failure, wait_for_device_copies

__all__ = ["copy_tensor_to_host", "snapshot_to_host", "synchronize_if_cuda"]

logger = logging.getLogger(__name__)


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


def synchronize_if_cuda(tensors: List[torch.Tensor], holding: Any = None) -> None:
    """Wait, bounded, for the device-to-host copies this thread queued from every CUDA
    device among ``tensors`` (each device's current stream, not just the current device's:
    a copy from another device runs on that device's stream).

    ``holding``: the host memory the copies write into, kept alive if they may still run.

    Raises:
        DeviceCopyTimeoutError: a device made no progress within
            :data:`~megatron_async.core.config.STAGING_WAIT_S`.
    """
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    if devices:
        wait_for_device_copies(devices, holding=holding)


def snapshot_to_host(obj: Any) -> Any:
    """Copy every tensor in a nested dict/list/tuple structure to host memory.

    Containers are rebuilt with their own type (dict subclasses such as OrderedDict
    included); other leaves are returned as they are, since the caller snapshots them
    anyway (a fork or a pickle happens before the trainer continues). Tensors are
    copied into one shared-memory segment (a forked writer then reads it without
    copy-on-write, and the persistent worker maps it once), page-locked when some are
    on a CUDA device; if shared memory is short, into private memory.
    """
    tensors: List[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.device.type in ("cpu", "cuda") and value.layout is torch.strided and value.numel():
                tensors.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    collect(obj)
    place = _segment_places(tensors)
    cuda_sources: List[torch.Tensor] = []

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type == "cuda":
                cuda_sources.append(value)
            host = place(value)
            if host is None:
                return copy_tensor_to_host(value)
            host.copy_(value.detach(), non_blocking=value.device.type == "cuda")
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

    try:
        result = visit(obj)
    except BaseException:  # copies queued so far: their memory stays until they land
        landed_after_failure({t.device for t in cuda_sources}, holding=place)
        raise
    synchronize_if_cuda(cuda_sources, holding=result)
    return result


def _segment_places(tensors: List[torch.Tensor]):
    """Allocate one shared segment for ``tensors``; return ``tensor -> its host buffer or None``."""
    from megatron_async.core import shared_memory
    from megatron_async.errors import StagingMemoryError

    offsets = {}
    total = 0
    for tensor in tensors:
        if id(tensor) not in offsets:
            offsets[id(tensor)] = shared_memory.aligned(total)
            total = offsets[id(tensor)] + tensor.numel() * tensor.element_size()
    segment = None
    if total:
        try:
            segment = shared_memory.allocate_segment(total)
        except StagingMemoryError as exc:
            logger.warning("staging in private memory: %s", exc)
    if segment is not None and any(t.device.type == "cuda" for t in tensors):
        shared_memory.pin_segment(segment)

    def place(tensor: torch.Tensor) -> Optional[torch.Tensor]:
        start = offsets.get(id(tensor))
        if segment is None or start is None:
            return None
        return shared_memory.segment_view(segment, start, tuple(tensor.shape), tensor.dtype)

    return place
