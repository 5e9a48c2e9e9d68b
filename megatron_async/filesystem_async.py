"""Public import path of :class:`FileSystemWriterAsync`, as megatron-core names it.

``megatron.core.dist_checkpointing.strategies.filesystem_async`` and
``nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async`` users switch by
importing from here; the implementation lives in :mod:`megatron_async.writer`.
"""

from megatron_async.writer.filesystem import (
    ConsistentDataIdentifier,
    FileSystemWriterAsync,
    get_write_results_queue,
)

__all__ = ["FileSystemWriterAsync", "ConsistentDataIdentifier", "get_write_results_queue"]
