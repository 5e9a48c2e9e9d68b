"""nvidia-resiliency-ext's async checkpointing module set, implemented by this package.

megatron-core 0.17+ runs async saves through
``nvidia_resiliency_ext.checkpointing.async_ckpt.{core, filesystem_async,
state_dict_saver, cached_metadata_filesystem_reader}``. The same modules, names and
keyword arguments exist here, so code written against them switches by its import
prefix::

    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
    from megatron_async.nvrx.core import AsyncCallsQueue          # the switch

For code one cannot edit (megatron-core's own ``get_async_strategy("nvrx")``, called by
``dist_checkpointing.save``), :func:`serve_as_nvidia_resiliency_ext` makes those module
paths resolve to ours in this process, when nvidia-resiliency-ext is not installed.

It serves the local checkpoint package ``nvidia_resiliency_ext.checkpointing.local``
too (Megatron-LM's ``--non-persistent-ckpt-type local``, and the base class of
megatron-core's ``MCoreTensorAwareStateDict``): each of its submodules is one of our
:mod:`megatron_async.local` modules under nvidia-resiliency-ext's path
(:data:`_SERVED_LOCAL`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = ["NVRX_INTERFACE_VERSION", "serve_as_nvidia_resiliency_ext", "is_served"]

NVRX_INTERFACE_VERSION = "0.6.0"
"""The nvidia-resiliency-ext release whose async checkpointing interface we implement.

It is the ``__version__`` of the served package, which megatron-core checks
(``NVRX_MIN_VERSION``) before it uses the modules."""

_NVRX_PACKAGE = "nvidia_resiliency_ext"
_ASYNC_CKPT = "nvidia_resiliency_ext.checkpointing.async_ckpt"
_SERVED_SUBMODULES = (
    "core",
    "filesystem_async",
    "state_dict_saver",
    "cached_metadata_filesystem_reader",
    "torch_ckpt",
)
_LOCAL = "nvidia_resiliency_ext.checkpointing.local"
_SERVED_LOCAL = {
    "base_state_dict": "megatron_async.local.state_dict",
    "basic_state_dict": "megatron_async.local.state_dict",
    "ckpt_managers.base_manager": "megatron_async.local.manager",
    "ckpt_managers.local_manager": "megatron_async.local.manager",
    "replication.strategies": "megatron_async.local.cliques",
    "replication.group_utils": "megatron_async.local.cliques",
}
"""nvidia-resiliency-ext's local submodules and ours that carry their names (two of its
modules may be one of ours: the names, not the split, are the contract)."""


def is_served() -> bool:
    """Whether ``nvidia_resiliency_ext`` in this process is our module surface."""
    package = sys.modules.get(_NVRX_PACKAGE)
    return bool(getattr(package, "__megatron_async__", False))


def _namespace(name: str, doc: str) -> types.ModuleType:
    """An empty package module whose submodules can only be the ones we register."""
    module = types.ModuleType(name, doc)
    module.__path__ = []  # a package, but nothing is found under it: other imports fail cleanly
    module.__megatron_async__ = True
    return module


def serve_as_nvidia_resiliency_ext() -> None:
    """Make ``nvidia_resiliency_ext.checkpointing.async_ckpt.*`` resolve to our modules.

    Call it on every rank, once, before the first save (ideally before megatron-core's
    ``dist_checkpointing`` is imported, so its type checks see the modules too). After
    it, megatron-core 0.17+'s stock ``TorchDistSaveShardedStrategy`` with
    ``async_strategy="nvrx"`` (its default) plans, stages, writes and commits through
    this package, and Megatron-LM's ``--async-save`` runs without nvidia-resiliency-ext.
    The local checkpoint modules are served as well (``LocalCheckpointManager``,
    ``CliqueReplicationStrategy``, ``TensorAwareStateDict``; call this before
    megatron-core's ``tensor_aware_state_dict`` is imported, which picks its base class
    once). Nothing else is: ``import nvidia_resiliency_ext.<anything else>`` still raises
    ``ModuleNotFoundError``.
    Calling it again is a no-op.

    Raises:
        ModuleSurfaceConflictError: nvidia-resiliency-ext is installed; megatron-core
            uses it then. To run our pipeline anyway, pass our strategy
            (``megatron_async.TorchDistAsyncSaveStrategy``) to ``dist_checkpointing.save``.
    """
    if is_served():
        return
    from megatron_async.errors import ModuleSurfaceConflictError

    if _NVRX_PACKAGE in sys.modules or importlib.util.find_spec(_NVRX_PACKAGE) is not None:
        raise ModuleSurfaceConflictError(
            "nvidia-resiliency-ext is installed, so megatron-core's async_strategy='nvrx' "
            "already uses it; to save through megatron_async instead, pass "
            "sharded_strategy=megatron_async.TorchDistAsyncSaveStrategy(...) to "
            "dist_checkpointing.save (it runs our pipeline whatever async_strategy says)"
        )
    package = _namespace(_NVRX_PACKAGE, "Served by megatron_async.nvrx (async and local checkpointing only).")
    package.__version__ = NVRX_INTERFACE_VERSION
    checkpointing = _namespace(f"{_NVRX_PACKAGE}.checkpointing", None)
    async_ckpt = _namespace(_ASYNC_CKPT, None)
    package.checkpointing = checkpointing
    checkpointing.async_ckpt = async_ckpt
    served = {
        _NVRX_PACKAGE: package,
        checkpointing.__name__: checkpointing,
        _ASYNC_CKPT: async_ckpt,
    }
    for name in _SERVED_SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        setattr(async_ckpt, name, module)
        served[f"{_ASYNC_CKPT}.{name}"] = module
    served[_LOCAL] = checkpointing.local = _namespace(_LOCAL, None)
    for name, ours in _SERVED_LOCAL.items():
        parent, _, leaf = f"{_LOCAL}.{name}".rpartition(".")
        if parent not in served:
            served[parent] = _namespace(parent, None)
            setattr(served[parent.rpartition(".")[0]], parent.rpartition(".")[2], served[parent])
        served[f"{parent}.{leaf}"] = importlib.import_module(ours)
        setattr(served[parent], leaf, served[f"{parent}.{leaf}"])
    sys.modules.update(served)
