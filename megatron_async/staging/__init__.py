"""Host staging: the snapshot that lets the trainer change its tensors right after scheduling.

Runs in the trainer, on every rank (a request's ``preload_fn``), except where noted:

* :mod:`.stager`: one save's stager, every mode as one pipeline, and the storage
  writer's one entry into staging;
* :mod:`.budget`: the ``staging_memory_limit``: the ledger of staging memory held by
  saves still being written, the pool for rounds, and a layout's buffers kept for its
  next save;
* :mod:`.buffers`: write buckets copied into shared-memory buffers, reused save after
  save; :mod:`.flat_copy`: a cached bucket of CPU tensors copied with one
  ``torch.cat``, a large one in parts on helper threads;
* :mod:`.rounds`: a state larger than the budget, staged and written in rounds;
* :mod:`.overlapped`: the copy made after the hand-over (overlapped, or the later
  rounds) on a helper thread, the one wait for it, and overlapped staging's rules;
* :mod:`.gate`: the one gate between the stager and the writer of a save (both sides);
* :mod:`.torch_save`: a :class:`~megatron_async.torch_ckpt.TorchAsyncCheckpoint` save's
  object pickled at once, its storages staged within the budget.

All allocate through :mod:`megatron_async.core.shared_memory`.
"""
