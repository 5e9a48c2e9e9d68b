"""The megatron-core integration: the save strategy that ``dist_checkpointing.save`` calls.

* :mod:`.generation`: everything that differs between megatron-core generations
  (0.16.x registry, 0.17+ built-in strategy); the only module to touch when upstream
  changes again;
* :mod:`.strategy` and :mod:`.config`: :class:`TorchDistAsyncSaveStrategy` and its options;
* :mod:`.plan_cache` and :mod:`.structure`: warm saves that skip planning;
* :mod:`.target`: the checks of a save's target directory (overwriting included);
* :mod:`.save_call`: megatron-core's ``save()`` wrapped, so that its steps before the
  strategy (its ``common.pt`` write on 0.16-0.18 included) know the call's strategy, and
  its finalize steps (``metadata.json``, manifest) replaced by gloo-safe ones.

Importing this package imports megatron-core. The public import path of the strategy is
``megatron_async.TorchDistAsyncSaveStrategy``.
"""

# First: an unsupported megatron-core fails here with one clear error, before any other
# module of this package imports a megatron-core interface that may be missing.
from megatron_async.mcore import generation  # noqa: F401
