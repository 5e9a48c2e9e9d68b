"""Plan and finalize an asynchronous PyTorch DCP save (every rank, collectives on gloo).

* :mod:`.state_dict_saver`: ``save_state_dict_async_plan`` /
  ``save_state_dict_async_finalize``, the DCP-level steps before and after the
  background write;
* :mod:`.agreement`: a check that failed on some ranks becomes one typed error on all.
"""

from megatron_async.saver.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
    verify_global_md_reuse,
)

__all__ = ["save_state_dict_async_plan", "save_state_dict_async_finalize", "verify_global_md_reuse"]
