"""Host staging: the snapshot that lets the trainer change its tensors right after scheduling.

Runs in the trainer, on every rank (a request's ``preload_fn``):

* :mod:`.buckets`: a save's write buckets copied into shared-memory segments, reused
  from save to save through a :class:`~.buckets.StagingBufferCache`;
* :mod:`.snapshot`: any nested structure of tensors copied to host memory (the
  ``torch.save``-style path of :class:`~megatron_async.torch_ckpt.TorchAsyncCheckpoint`).

Both allocate through :mod:`megatron_async.core.shared_memory`.
"""

from megatron_async.staging.snapshot import copy_tensor_to_host, snapshot_to_host, synchronize_if_cuda

__all__ = ["copy_tensor_to_host", "snapshot_to_host", "synchronize_if_cuda"]
