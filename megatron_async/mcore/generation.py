"""Everything that differs between megatron-core generations, in one place (every rank).

megatron-core changed how a save strategy plugs in:

* up to 0.16.x a strategy is found in a registry (``strategies.base``:
  ``register_default_strategy``, ``AsyncSaveShardedStrategy``); ``save()`` writes
  ``common.pt`` through the registered ``torch`` common strategy before the sharded one;
* from 0.17 the registry is gone, ``save()`` keeps a sharded strategy only if it is a
  ``TorchDistSaveShardedStrategy`` (or the fully parallel wrapper) and calls its
  ``async_save(sharded_state_dict, checkpoint_dir, async_strategy)``. 0.17 and 0.18
  still write ``common.pt``, through a plain ``serialization.save_common`` function;
  from 0.19 the common state is a ``common_state`` object inside the checkpoint.

The integration is chosen by the features present, never by version strings:
:data:`GENERATION` is ``"registry"`` when ``strategies.base`` has
``register_default_strategy`` and ``"builtin"`` when ``strategies.torch`` has
``TorchDistSaveShardedStrategy`` without it. Anything else raises
:class:`~megatron_async.errors.UnsupportedMegatronError` at import, naming what is
missing. The other modules of :mod:`megatron_async.mcore` use only the names below.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List

from megatron_async.errors import UnsupportedMegatronError

__all__ = [
    "GENERATION",
    "SUPPORTED_RANGE",
    "StrategyBase",
    "to_dcp_state_dict",
    "create_save_planner",
    "register_strategies",
    "resolve_strategy",
    "common_writes",
]

SUPPORTED_RANGE = "megatron-core 0.16.x (strategy registry) and 0.17 to 0.19.x"

try:
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
except ImportError as exc:
    raise UnsupportedMegatronError(
        "megatron.core.dist_checkpointing.strategies.torch with MCoreSavePlanner, "
        f"_replace_state_dict_keys_with_sharded_keys and mcore_to_pyt_state_dict is not "
        f"importable ({exc}); megatron_async supports {SUPPORTED_RANGE}"
    ) from exc

try:
    from megatron.core.dist_checkpointing.strategies.base import (
        AsyncSaveShardedStrategy as StrategyBase,
        StrategyAction,
        get_default_strategy,
        register_default_strategy,
    )

    GENERATION = "registry"
except ImportError:
    try:
        from megatron.core.dist_checkpointing.strategies.torch import (
            TorchDistSaveShardedStrategy as StrategyBase,
        )
    except ImportError as exc:
        raise UnsupportedMegatronError(
            "this megatron-core has neither a strategy registry "
            "(strategies.base.register_default_strategy) nor "
            "strategies.torch.TorchDistSaveShardedStrategy; megatron_async supports "
            f"{SUPPORTED_RANGE}"
        ) from exc
    GENERATION = "builtin"


def to_dcp_state_dict(sharded_state_dict: Any, config: Any) -> Dict[str, Any]:
    """megatron-core's translation of a sharded state dict into a DCP one (every rank, local)."""
    flat_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
        sharded_state_dict, config.keep_only_main_replica
    )
    return mcore_to_pyt_state_dict(flat_state_dict, False)


def create_save_planner(config: Any) -> Any:
    """megatron-core's save planner for ``config`` (every rank)."""
    return MCoreSavePlanner(
        flatten_state_dict=False,
        dedup_replicated_tensors=not config.keep_only_main_replica,
        can_run_decentralized_global_plan=config.keep_only_main_replica,
    )


def register_strategies(strategy_cls: type, backend_name: str) -> None:
    """Make ``strategy_cls`` megatron-core's default for ``backend_name`` where a registry
    exists (0.16.x); from 0.17 there is none."""
    if GENERATION == "registry":
        register_default_strategy(StrategyAction.SAVE_SHARDED, backend_name, 1, strategy_cls())


def resolve_strategy(strategy: Any) -> Any:
    """``save()``'s ``sharded_strategy`` argument as the strategy ``save()`` uses: a
    backend name resolved through the registry (0.16.x), or None (an unknown name; from
    0.17 ``save()`` replaces anything but a strategy with its own); a strategy as it is."""
    if not isinstance(strategy, tuple):
        return strategy
    if GENERATION != "registry":
        return None
    try:
        return get_default_strategy(StrategyAction.SAVE_SHARDED, *strategy)
    except Exception:  # save() itself reports an unknown backend
        return None


def common_writes() -> List[Any]:
    """Where ``save()`` writes ``common.pt`` before the sharded strategy (see the module
    docstring): the objects whose ``save_common`` does it, none from 0.19."""
    if GENERATION == "registry":
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy

        return [TorchCommonSaveStrategy]
    serialization = importlib.import_module("megatron.core.dist_checkpointing.serialization")
    return [serialization] if callable(getattr(serialization, "save_common", None)) else []
