"""Options of the megatron-core save strategy (every rank; the same on all ranks).

The writer's share of them is a :class:`~megatron_async.writer.options.WriteOptions`
(:attr:`TorchDistSaveConfig.write_options`), which validates them: an invalid option
raises :class:`~megatron_async.errors.CheckpointValidationError` when the config is made.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from megatron_async.storage.locations import DEFAULT_PART_BYTES
from megatron_async.writer.options import DEFAULT_WRITE_TIMEOUT_S, WriteOptions

__all__ = ["TorchDistSaveConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchDistSaveConfig:
    """Options of :class:`TorchDistAsyncSaveStrategy`.

    Raises:
        CheckpointValidationError: an option out of range, with the rule it breaks.
        ObjectStoreUnavailableError: ``use_msc`` without multi-storage-client installed.
    """

    thread_count: int = 2
    """Files (and writer threads or processes) per rank and save."""

    cached_metadata: bool = False
    """Reuse the previous save's plans and metadata while the checkpoint structure does not
    change (verified on every save with one small all-reduce): no plan gather then, and
    no local planning either while the sharded state dict's fingerprint is unchanged.
    megatron-core's ``use_cached_ckpt_structure`` (Megatron-LM's
    ``--ckpt-assume-constant-structure``) sets it."""

    separation_hint: Optional[str] = None
    """Keys starting with this prefix are written to their own files (``{hint}__{rank}_{i}``),
    which megatron-core's ``remove_sharded_tensors`` can later drop."""

    keep_only_main_replica: bool = True
    """Save only main replicas (``replica_id`` 0). False saves every replica and lets DCP
    deduplicate, which needs central planning (one gather and one scatter per save)."""

    is_multiproc_io: bool = False
    """Write buckets with forked processes instead of threads."""

    use_cached_data_structure: bool = True
    """Keep the host staging buffers from save to save: a save whose bucket layout is the
    previous save's stages into that save's buffers (already mapped; one memory copy),
    a changed layout frees them and allocates anew, so at most one checkpoint's bytes stay
    held between saves (:meth:`TorchDistAsyncSaveStrategy.release_staging_buffers` frees
    them on request). Safe with any structure: the layout is compared on every save.
    False frees the staging memory after every save, for jobs short on host memory."""

    overwrite: bool = True
    """A directory that holds a complete checkpoint is overwritten (its completion markers
    removed first, with a warning); False refuses it with a CheckpointValidationError."""

    sync_files: bool = True
    """fsync every file before the save counts as written."""

    checksums: bool = True
    """Hash every item while it is written (xxh3, in the background writer) and store the
    digests next to the data, for ``python -m megatron_async verify`` and
    :func:`megatron_async.integrity.verify.verify_checkpoint_integrity`."""

    fail_on_stale_checkpoint: bool = False
    """With ``checksums``, the coordinator compares every item's digest with the previous
    save's of this strategy: when none changed (the same weights written again into a new
    checkpoint, the symptom of stale cached tensors) it logs a WARNING naming both
    checkpoints; True fails that save instead (no ``.metadata``). Saves where only some
    items changed (frozen parameters) are normal and only counted in the per-save INFO line."""

    direct_io: bool = True
    """Write local checkpoint files with ``O_DIRECT`` (through an aligned bounce buffer),
    bypassing the page cache, where the file system accepts it: far less CPU per byte
    than buffered writes plus the kernel's writeback, which the training pays for while
    a background write runs. False writes through the page cache."""

    overlap_staging: bool = False
    """Overlapped staging: scheduling returns after planning, and the host copy runs in a
    background thread while the next forward/backward runs; the next optimizer step waits
    for it (see :mod:`megatron_async.staging.overlapped` for the rules)."""

    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    """Bound on the background writer's wait for its threads or processes."""

    object_part_bytes: int = DEFAULT_PART_BYTES
    """With ``use_msc``: bytes per uploaded part of a multipart upload (at least 5 MiB),
    about the memory each file's upload holds."""

    object_request_timeout_s: float = WriteOptions.object_request_timeout_s
    """With ``use_msc``: the most one request to the store (one uploaded part, the
    ``.metadata`` PUT) may take, answer included; an endpoint that stops answering, or
    answers a byte at a time, fails the save on every rank."""

    object_request_retries: int = WriteOptions.object_request_retries
    """With ``use_msc``: further attempts of a request after a transient failure
    (timeouts, dropped connections, throttling, 5xx), with exponential backoff."""

    use_msc: bool = False
    """Save to object storage through multi-storage-client: checkpoint directories are
    ``msc://PROFILE/PREFIX`` URLs (megatron-core's ``--enable-msc``; Megatron-LM's
    ``use_msc``). Needs the ``msc`` extra (``pip install megatron-async[msc]``)."""

    staging_memory_limit: Optional[Union[int, float]] = None
    """The most host staging memory (shared memory) this rank's saves hold at once: bytes
    (int), or a fraction of the node's memory shared by its local ranks (float in (0, 1]).
    None: one copy of the state (a save scheduled while the previous one is still written
    waits for it instead of staging a second copy). A state larger than the limit is
    staged and written in rounds through a pool of the limit's size (the trainer waits
    for the writer to drain; with ``overlap_staging``, the next optimizer step does); a
    single tensor larger than the limit is refused with a ``StagingMemoryError`` naming it."""

    def __post_init__(self) -> None:
        # Built (and so validated) once per config; every save's writer gets this object.
        write_options = WriteOptions(
            thread_count=self.thread_count,
            sync_files=self.sync_files,
            separation_hint=self.separation_hint,
            is_multiproc_io=self.is_multiproc_io,
            use_cached_data_structure=self.use_cached_data_structure,
            write_timeout_s=self.write_timeout_s,
            checksums=self.checksums,
            use_msc=self.use_msc,
            object_part_bytes=self.object_part_bytes,
            object_request_timeout_s=self.object_request_timeout_s,
            object_request_retries=self.object_request_retries,
            overlap_staging=self.overlap_staging,
            direct_io=self.direct_io,
            staging_memory_limit=self.staging_memory_limit,
        )
        object.__setattr__(self, "_write_options", write_options)

    @property
    def write_options(self) -> WriteOptions:
        """The options of this config's storage writers (every rank)."""
        return self._write_options
