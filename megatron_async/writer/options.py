"""The options of one storage writer, as one validated object (trainer side, every rank).

:class:`WriteOptions` is built once, validated in ``__post_init__``, and passed to the
writer as it is: the strategy's :class:`~megatron_async.mcore.config.TorchDistSaveConfig`
is a subclass with the strategy's own options (its writers get its ``write_options``),
and :class:`~megatron_async.writer.filesystem.FileSystemWriterAsync` builds one from the
reference API's keyword arguments.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

from megatron_async.core.config import DEFAULT_CONFIG
from megatron_async.errors import CheckpointValidationError
from megatron_async.storage.bounded_calls import REQUEST_TIMEOUT_S
from megatron_async.storage.stream import DEFAULT_PART_BYTES, MIN_PART_BYTES

__all__ = ["WriteOptions", "DEFAULT_WRITE_TIMEOUT_S"]

DEFAULT_WRITE_TIMEOUT_S = DEFAULT_CONFIG.timeout_s
"""How long the background writer waits for one save's bucket threads: by
default as long as a caller lets the whole background part run
(``AsyncCallerConfig.timeout_s``), since the writer is built before any caller is known."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How a :class:`~megatron_async.writer.filesystem.FileSystemWriterAsync` writes a save.

    The defaults are the writer's (those of PyTorch DCP's ``FileSystemWriter`` for
    ``thread_count`` and ``sync_files``); the strategy's config changes two of them.

    Raises:
        CheckpointValidationError: an option out of range, with the rule it breaks.
        ObjectStoreUnavailableError: ``use_msc`` without multi-storage-client installed.
    """

    thread_count: int = 1
    """Files (and writer threads) per rank and save; at least 1."""

    sync_files: bool = True
    """fsync every file before the save counts as written."""

    separation_hint: Optional[str] = None
    """Items whose key starts with it go to separate files ``{hint}__{rank}_{idx}.distcp``,
    which megatron-core's ``remove_sharded_tensors`` can later drop; a non-empty prefix
    without the path separator, since it starts file names."""

    is_multiproc_io: bool = False
    """The reference API's choice of forked processes per bucket; accepted, and the
    buckets are written on threads either way (see :mod:`megatron_async.writer.write_paths`)."""

    use_cached_data_structure: bool = False
    """Reuse the staging buffers of the previous save of the same bucket layout."""

    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    """Bound on the background writer's wait for its buckets; positive."""

    checksums: bool = True
    """Hash every item while it is written (xxh3, in the background writer) and store the
    digests next to the data before ``.metadata``, for ``python -m megatron_async verify``
    and :func:`megatron_async.integrity.verify_checkpoint_integrity`."""

    use_msc: bool = False
    """Save to object storage through multi-storage-client: the checkpoint is an
    ``msc://PROFILE/PREFIX`` URL (megatron-core's ``--enable-msc``; Megatron-LM's
    ``use_msc``), and every bucket is streamed to the store as it is written. Needs the
    ``msc`` extra (``pip install megatron-async[msc]``)."""

    object_part_bytes: int = DEFAULT_PART_BYTES
    """With ``use_msc``, bytes per uploaded part (at least S3's smallest, 5 MiB): about
    the memory each bucket's upload holds."""

    object_request_timeout_s: float = REQUEST_TIMEOUT_S
    """With ``use_msc``, the most one request to the store (one uploaded part, the
    ``.metadata`` PUT) may take, answer and the client's retries included; beyond it the
    save fails on every rank (see :mod:`megatron_async.storage.bounded_calls`)."""

    overlap_staging: bool = False
    """Overlapped staging: ``preload_fn`` only leases the staging buffers, scheduling
    returns after planning, and the host copy runs in a background thread while the next
    forward/backward runs; ``save_fn`` and the next optimizer step wait for it (see
    :mod:`megatron_async.staging.overlapped` for the rules)."""

    direct_io: bool = True
    """Write local files with ``O_DIRECT``, bypassing the page cache, where the file
    system accepts it: far less CPU per byte, which the training pays for while a
    background write runs (:mod:`megatron_async.buckets.direct_io`). False writes through
    the page cache."""

    staging_memory_limit: Optional[Union[int, float]] = None
    """The most host staging memory (shared memory) this rank's saves hold at once: bytes
    (int), or a fraction of the node's memory shared by its local ranks (float in (0, 1]).
    None: one copy of the state (a save scheduled while the previous one is still written
    waits for it instead of staging a second copy). A state larger than the limit is
    staged and written in rounds through a pool of the limit's size (the trainer waits
    for the writer to drain; with ``overlap_staging``, the next optimizer step does); a
    single tensor larger than the limit is refused with a ``StagingMemoryError`` naming it
    (see :mod:`megatron_async.staging.budget`)."""

    def __post_init__(self) -> None:
        count = self.thread_count
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise CheckpointValidationError(
                f"thread_count must be an int >= 1 (files per rank), got {count!r}"
            )
        if self.separation_hint is not None and (
            not isinstance(self.separation_hint, str)
            or not self.separation_hint
            or os.sep in self.separation_hint
        ):
            raise CheckpointValidationError(
                f"separation_hint must be a non-empty key prefix without {os.sep!r} (it starts "
                f"file names), got {self.separation_hint!r}"
            )
        for name in ("write_timeout_s", "object_request_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise CheckpointValidationError(f"{name} must be a positive number of seconds, got {value!r}")
        from megatron_async.staging.budget import validate_staging_memory_limit

        validate_staging_memory_limit(self.staging_memory_limit)
        if self.use_msc:
            from megatron_async.storage.client import import_msc

            import_msc()  # ObjectStoreUnavailableError naming the extra
            if self.object_part_bytes < MIN_PART_BYTES:
                raise CheckpointValidationError(
                    f"object_part_bytes must be >= {MIN_PART_BYTES} (S3's smallest part), got "
                    f"{self.object_part_bytes}"
                )
