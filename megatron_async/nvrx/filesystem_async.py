"""``nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async``: the storage writer."""

from megatron_async.filesystem_async import FileSystemWriterAsync

__all__ = ["FileSystemWriterAsync"]
