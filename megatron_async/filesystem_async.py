"""Public import path of :class:`FileSystemWriterAsync`, as megatron-core names it.

``megatron.core.dist_checkpointing.strategies.filesystem_async`` users switch by
importing from here; the implementation lives in :mod:`megatron_async.writer`.
"""

from megatron_async.writer.filesystem import DEFAULT_WRITE_TIMEOUT_S, FileSystemWriterAsync

__all__ = ["FileSystemWriterAsync", "DEFAULT_WRITE_TIMEOUT_S"]
