"""Integrity of written checkpoints: checksums, completeness, inspection, staleness.

* :mod:`.checksums` (background writer and tools): the xxh3 digests of every item,
  computed while writing and re-checked on demand;
* :mod:`.inspection` (one process): what a checkpoint holds and whether it is complete;
* :mod:`.verify`: re-hash and report damage (the ``verify`` command; every rank in the
  opt-in check before loading, :func:`~megatron_async.integrity.verify.verify_checkpoint_integrity`);
* :mod:`.staleness` (every rank, while a save is finalized): did anything change since
  the previous save?
"""
