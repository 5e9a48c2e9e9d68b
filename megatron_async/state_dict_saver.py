"""Public import path of the async save steps, as megatron-core names it.

``megatron.core.dist_checkpointing.strategies.state_dict_saver`` users switch by
importing from here; the implementation lives in :mod:`megatron_async.saver`.
nvidia-resiliency-ext's convention (``enable_cache`` / ``metadata_cache``) is
:mod:`megatron_async.nvrx.state_dict_saver`'s.
"""

from megatron_async.saver.finalize import save_state_dict_async_finalize
from megatron_async.saver.metadata_cache import verify_global_md_reuse
from megatron_async.saver.state_dict_saver import save_state_dict_async_plan

__all__ = ["save_state_dict_async_plan", "save_state_dict_async_finalize", "verify_global_md_reuse"]
