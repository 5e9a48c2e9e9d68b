"""Host staging: the snapshot that lets the trainer change its tensors right after scheduling.

Runs in the trainer, on every rank (a request's ``preload_fn``), except where noted:

* :mod:`.buffers`: a save's write buckets copied into shared-memory segments, reused
  from save to save through a :class:`~.buffer_cache.StagingBufferCache`
  (:mod:`.buffer_cache`: the reusable buffers, lent to one save at a time);
* :mod:`.flat_copy`: a cached bucket of CPU tensors copied with one ``torch.cat``, a large
  one in parts on the helper threads of the process, each part's wait bounded;
* :mod:`.stager`: one save's stager (:class:`~.stager.BucketStager`), every mode as one
  pipeline: buffers from the layout cache or the budget's pool, copied by the training
  thread or the copy thread;
* :mod:`.budget`: the ``staging_memory_limit``: the ledger of staging memory held by
  saves still being written, and the pool for rounds;
* :mod:`.rounds`: a state larger than the budget, staged and written in rounds through
  one bounded pool;
* :mod:`.gate`: the one gate between the stager and the writer of a save, whatever the
  mode (both sides): failed or not, and per item copied or written;
* :mod:`.copy_job`: the one copy that runs after the hand-over, in one go or in rounds,
  checking every tensor's version (the overlapped copy and the later rounds), on a
  helper thread of the process, and the one wait for it;
* :mod:`.overlapped`: the copy on a trainer thread (a CUDA side stream with GPUs), waited
  for before the next in-place update; above the budget, the pool placed at scheduling,
  every round copied by that thread, the next optimizer step waiting for the last;
* :mod:`.torch_save`: the object of a :class:`~megatron_async.torch_ckpt.TorchAsyncCheckpoint`
  save pickled at once, its storages staged within the budget (in one go or in rounds);

All allocate through :mod:`megatron_async.core.shared_memory`.
"""
