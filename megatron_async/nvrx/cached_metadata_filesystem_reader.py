"""``nvidia_resiliency_ext.checkpointing.async_ckpt.cached_metadata_filesystem_reader``."""

from megatron_async.cached_metadata_filesystem_reader import CachedMetadataFileSystemReader

__all__ = ["CachedMetadataFileSystemReader"]
