"""The storage writer: how staged buckets become durable ``.distcp`` files.

* :mod:`.filesystem` (trainer, every rank): :class:`FileSystemWriterAsync`, the PyTorch
  DCP storage writer that prepares buckets, hands them to staging once
  (:func:`megatron_async.staging.stager.prepare_staged_write`) and the write to a
  background caller;
* :mod:`.options` (trainer): ``WriteOptions``, the writer's options, validated once;
* :mod:`.write_paths` (background writer): how a process writes its staged buckets, one
  thread per bucket with bounded waits, then this rank's checksum record; the reference
  API's ``write_preloaded_data*`` paths that :class:`FileSystemWriterAsync` delegates to;
* :mod:`.bucket_io` and :mod:`.tensor_archive` (background writer): one bucket's bytes
  in DCP's ``torch_save`` layout, hashed on the way, into the bucket files of
  :mod:`megatron_async.buckets`;
* :mod:`.results` (both sides): the result channel from the writer to the trainer, and
  the trainer's retrieval of the results from it;
* :mod:`.commit` (coordinator): ``.metadata``, built from the write results or reused,
  and (every rank) whether this rank stored every item where its previous save did;
  :mod:`.metadata_bytes` (coordinator): the previous ``.metadata`` pickle with the new
  ``storage_meta`` spliced in;
* :mod:`.torch_save_file` (background writer): a ``torch.save`` file of
  ``TorchAsyncCheckpoint``, written record by record from its staged storages.
"""
