"""The save methods the benchmarks compare: one hierarchy, used by every benchmark.

Every module runs on every rank (the trainer's side), except :mod:`._bg_timing`, whose
:func:`~._bg_timing.timed_call` runs where the background write runs.

* :mod:`.base`       the interface (:class:`~.base.SaveMethod`: ``start_early``, ``setup``,
  ``save``, ``poll``, ``wait``, ``close``, and the moments of the last save), and
  :class:`~.base.Unsupported`;
* :mod:`.queue`      ``dist_checkpointing.save`` on a queue: ours (our strategy on our
  callers) and megatron-core's own ``torch_dist`` async save;
* :mod:`.dcp`        PyTorch DCP's ``save`` and ``async_save`` (thread or process executor,
  per-call or reused ``DefaultStager``);
* :mod:`.example`    the GPT example's own ``Checkpointer`` (sync, or async on our callers);
* :mod:`.catalog`    which method each name of the benchmarks stands for;
* :mod:`._bg_timing` start and end stamps of a background write.

Kept free of imports: the persistent worker imports :mod:`._bg_timing`, and with it this
package, to unpickle a timed write.
"""
