"""Where checkpoints live: one storage interface, chosen once from the path.

A checkpoint "directory" is a local path or an ``msc://PROFILE/PREFIX`` URL of NVIDIA's
multi-storage-client (MSC): MSC's configuration (``MSC_CONFIG`` or
``~/.msc_config.yaml``) says which store a profile is (an S3-compatible endpoint, or a
POSIX directory) and with which credentials. The optional ``msc`` extra installs it
(``pip install megatron-async[msc]``).

* :mod:`.backend` (anywhere): the :class:`CheckpointStorage` interface and
  :func:`storage_for`, which chooses the backend of a path;
* :mod:`.local` (anywhere): :class:`~.local.LocalStorage`, files with atomic renames and
  fsyncs;
* :mod:`.objects` (anywhere): :class:`~.objects.ObjectStorage`, whole objects (one PUT
  each), listing, deletion and ranged reads;
* :mod:`.stream` (the background writer): one bucket streamed to the store as it is
  written, as a multipart upload, hashed on the way;
* :mod:`.client` (anywhere): the URL scheme, the MSC import with its typed error, and
  URL resolution;
* :mod:`.bounded_calls` (anywhere): the deadline of every object-store request.
"""

from megatron_async.storage.backend import CheckpointStorage, is_object_url, normalize_checkpoint_path, storage_for
from megatron_async.storage.client import MSC_URL_PREFIX

__all__ = ["CheckpointStorage", "MSC_URL_PREFIX", "is_object_url", "normalize_checkpoint_path", "storage_for"]
