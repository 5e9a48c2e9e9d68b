"""Checkpoints in object storage, reached through NVIDIA's multi-storage-client (MSC).

A checkpoint "directory" may be an ``msc://PROFILE/PREFIX`` URL: MSC's configuration
(``MSC_CONFIG`` or ``~/.msc_config.yaml``) says which store a profile is (an
S3-compatible endpoint, or a POSIX directory) and with which credentials. The optional
``msc`` extra installs it (``pip install megatron-async[msc]``).

* :mod:`.locations` (anywhere, imports nothing): which paths are object URLs;
* :mod:`.client` (anywhere): the MSC import with its typed error, and URL resolution;
* :mod:`.objects` (the coordinator, loaders, tools): small whole objects (``.metadata``,
  checksums, the tracker), listing, deletion and ranged reads;
* :mod:`.stream` (the background writer): one bucket streamed to the store as it is
  written, as a multipart upload, hashed on the way.
"""

from megatron_async.storage.locations import MSC_URL_PREFIX, is_object_url, normalize_checkpoint_path

__all__ = ["MSC_URL_PREFIX", "is_object_url", "normalize_checkpoint_path"]
