"""``nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt``: async ``torch.save``."""

from megatron_async.torch_ckpt import TorchAsyncCheckpoint

__all__ = ["TorchAsyncCheckpoint"]
