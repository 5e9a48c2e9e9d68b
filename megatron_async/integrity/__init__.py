"""Integrity of written checkpoints: checksums, completeness, inspection.

* :mod:`.checksums` (background writer and tools): the xxh3 digests of every item,
  computed while writing and re-checked on demand;
* :mod:`.inspection` (one process): what a checkpoint holds and whether it is complete;
* :mod:`.verify`: re-hash and report damage (the ``verify`` command; every rank in the
  opt-in check before loading).

``verify_checkpoint_integrity`` is imported on first use, so that tools which only read
checksums do not import torch.distributed.
"""

__all__ = ["verify_checkpoint_integrity"]


def __getattr__(name):
    if name == "verify_checkpoint_integrity":
        from megatron_async.integrity.verify import verify_checkpoint_integrity

        return verify_checkpoint_integrity
    raise AttributeError(f"module 'megatron_async.integrity' has no attribute {name!r}")
