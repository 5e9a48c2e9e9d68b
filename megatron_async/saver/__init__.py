"""Plan and finalize an asynchronous PyTorch DCP save (every rank, collectives on gloo).

* :mod:`.state_dict_saver`: planning, ``plan_save`` (a :class:`PlanResult`) and the
  public ``save_state_dict_async_plan`` (megatron-core's convention), the DCP-level step
  before the background write;
* :mod:`.global_metadata` (coordinator): the global metadata from every rank's plan,
  validated with DCP's rules;
* :mod:`.finalize`: ``save_state_dict_async_finalize``, the commit after the write;
* :mod:`.metadata_cache`: the plans and metadata a later save (or a resumed job, through
  the plan digests in ``.metadata``) reuses.
"""
