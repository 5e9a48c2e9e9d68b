"""Options of the megatron-core save strategy (every rank; the same on all ranks).

:class:`TorchDistSaveConfig` is a :class:`~megatron_async.writer.options.WriteOptions`
(how the storage writer writes, validated there) with the strategy's own options added:
an invalid option raises :class:`~megatron_async.errors.CheckpointValidationError` when
the config is made.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron_async.writer.options import WriteOptions

__all__ = ["TorchDistSaveConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchDistSaveConfig(WriteOptions):
    """Options of :class:`TorchDistAsyncSaveStrategy`: every field of
    :class:`~megatron_async.writer.options.WriteOptions`, with the strategy's defaults
    for ``thread_count`` and ``use_cached_data_structure``, and the fields below.

    Raises:
        CheckpointValidationError: an option out of range, with the rule it breaks.
        ObjectStoreUnavailableError: ``use_msc`` without multi-storage-client installed.
    """

    thread_count: int = 2
    """Files (and writer threads) per rank and save."""

    use_cached_data_structure: bool = True
    """Keep the host staging buffers from save to save: a save with the previous save's
    bucket layout stages into its buffers (one memory copy), a changed layout frees them
    and allocates anew, so at most one checkpoint's bytes stay held between saves
    (:meth:`TorchDistAsyncSaveStrategy.release_staging_buffers` frees them on request).
    Safe with any structure, as the layout is compared on every save. False frees the
    staging memory after every save, for jobs short on host memory."""

    cached_metadata: bool = False
    """Reuse the previous save's plans and metadata while the checkpoint structure does not
    change (verified on every save with one small all-reduce): no plan gather then, and
    no local planning either while the sharded state dict's fingerprint is unchanged.
    megatron-core's ``use_cached_ckpt_structure`` (Megatron-LM's
    ``--ckpt-assume-constant-structure``) sets it."""

    keep_only_main_replica: bool = True
    """Save only main replicas (``replica_id`` 0). False saves every replica and lets DCP
    deduplicate, which needs central planning (one gather and one scatter per save)."""

    overwrite: bool = True
    """A directory that holds a complete checkpoint is overwritten (its completion markers
    removed first, with a warning); False refuses it with a CheckpointValidationError."""

    @functools.cached_property
    def write_options(self) -> WriteOptions:
        """The options of this config's storage writers (every rank; one object per config,
        which every save's writer gets)."""
        return WriteOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(WriteOptions)})
