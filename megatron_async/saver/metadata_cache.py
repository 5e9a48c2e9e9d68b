"""What a later save reuses: the latest save's plans and metadata, and the plan digests
a checkpoint stores for a resumed job (every rank, its own).

:class:`CheckpointMetadataCache` is the one cache of plans and global metadata: the
megatron-core strategy keeps one (:mod:`megatron_async.mcore.plan_cache`), and
megatron-core 0.17+ hands one to nvidia-resiliency-ext's ``save_state_dict_async_plan(...,
enable_cache=True, metadata_cache=cache)``. Both plan through
:func:`~megatron_async.saver.state_dict_saver.plan_with_cache`, which offers the cached
plans and a loaded checkpoint's plan digests for reuse and records the outcome here.
Reuse is decided by :func:`~megatron_async.saver.state_dict_saver.plan_save` against
fresh local plans on every rank, never from the cache's flags alone: a cache that says
"validated" cannot make a changed structure write stale metadata.

A resumed job skips its first save's plan gather when every rank's fresh local plan is
the one the loaded checkpoint was saved with. megatron-core stores every rank's whole
local plan for that (``all_local_plans``: at a million items more than half again the
size of DCP's ``.metadata``); here each rank's plan is a 16-byte digest of what the
comparison looks at, plain ``bytes`` that stock torch and megatron-core unpickle and
ignore; a checkpoint without them (megatron-core's own) is planned in full.

The digest is of the items' ``repr`` (fqn, offsets, sizes, tensor properties, global
size, type): deterministic across processes. A change of its rules changes
``_DIGEST_KEY``, so a checkpoint digested otherwise is simply not reused.
:func:`verify_global_md_reuse` is the comparison, agreed on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import operator
from typing import Any, List, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint.metadata import Metadata, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron_async.core import coordination

__all__ = [
    "CheckpointMetadataCache",
    "PLAN_DIGESTS_ATTR",
    "loaded_plans",
    "plan_digest",
    "properties_key",
    "same_plan",
    "verify_global_md_reuse",
]

logger = logging.getLogger(__name__)

PLAN_DIGESTS_ATTR = "megatron_async_plan_digests"
"""Attribute of the metadata: ``[bytes]``, one digest per rank, in rank order."""

_DIGEST_KEY = b"megatron_async.plan.v1"
_SHARD = WriteItemType.SHARD.name  # the usual type, named without an enum lookup per item
# TensorProperties' values in field order (an unpickled one holds its attributes in another
# order), hashable: the key of equal properties.
properties_key = operator.attrgetter(*(field.name for field in dataclasses.fields(TensorProperties)))
_PLAN_FIELDS_LEFT_OUT = ("items", "storage_data")


def plan_digest(plan: SavePlan) -> bytes:
    """16 bytes that differ between plans that differ apart from storage data and hints.

    Runs on every rank for its own plan, and on the coordinator for every rank's.
    """
    items = [_item_key(item) for item in plan.items]
    others = [
        (field.name, getattr(plan, field.name))
        for field in dataclasses.fields(plan)
        if field.name not in _PLAN_FIELDS_LEFT_OUT
    ]
    digest = hashlib.blake2b(key=_DIGEST_KEY, digest_size=16)
    digest.update(repr(items).encode())
    digest.update(repr(others).encode())
    return digest.digest()


def _item_key(item) -> tuple:
    data = item.tensor_data
    index = item.index
    if data is None:
        return (index.fqn, index.offset, item.type.name, getattr(item, "bytes_io_data", None))
    chunk = data.chunk
    return (
        index.fqn,
        index.offset,
        _SHARD if item.type is WriteItemType.SHARD else item.type.name,
        chunk.offsets,
        chunk.sizes,
        properties_key(data.properties),
        data.size,
    )


def loaded_plans(metadata: Optional[Metadata]) -> Optional[List[bytes]]:
    """The plan digests a loaded checkpoint's metadata stores, one per rank, or None
    (every rank)."""
    digests = getattr(metadata, PLAN_DIGESTS_ATTR, None)
    if isinstance(digests, list) and all(isinstance(d, bytes) for d in digests):
        return digests
    return None


def same_plan(plan: SavePlan, loaded: Any) -> bool:
    """Whether ``plan`` is the plan that ``loaded`` (a loaded digest or a cached plan)
    describes.

    Plans are compared on every field but the storage data; the index hints are left
    out of digests (``MetadataIndex`` equality ignores them too).
    """
    if loaded is None:
        return False
    if isinstance(loaded, bytes):
        return plan_digest(plan) == loaded
    return all(
        getattr(plan, field.name) == getattr(loaded, field.name)
        for field in dataclasses.fields(plan)
        if field.name != "storage_data"
    )


def verify_global_md_reuse(
    loaded_all_plans: Optional[Sequence[Union[bytes, SavePlan]]],
    local_plan: SavePlan,
    rank: int,
    dist_wrapper: _DistWrapper,
) -> bool:
    """Tell whether a loaded checkpoint's metadata fits this save on every rank.

    Runs on every rank and always costs one all-reduce (so that ranks with and without
    loaded plans stay in step). A rank agrees when the loaded plans are from a job of
    the same size and its own entry equals ``local_plan`` apart from the storage data.

    Args:
        loaded_all_plans: the loaded metadata's plan digests (:func:`loaded_plans`), the
            reference API's whole ``all_local_plans`` (a caller's own code may pass
            them), or None.
        local_plan: this rank's fresh local plan.
        rank: this rank's index in the planning group.
        dist_wrapper: the planning wrapper.

    Returns:
        True on every rank if every rank agrees, else False on every rank.
    """
    try:
        local_ok = (
            bool(loaded_all_plans)
            and len(loaded_all_plans) == dist_wrapper.get_world_size()
            and same_plan(local_plan, loaded_all_plans[rank])
        )
    except Exception as exc:  # an unexpected plan layout: plan afresh rather than diverge
        logger.debug("rank %d: cannot compare with the loaded plans: %s", rank, exc)
        local_ok = False
    if not local_ok and loaded_all_plans:
        logger.debug("rank %d: loaded checkpoint plans differ from this save's plan", rank)
    (any_mismatch,) = coordination.all_reduce_max([int(not local_ok)], dist_wrapper.group)
    return not any_mismatch


class CheckpointMetadataCache:
    """Plans and metadata of the latest save of one saver (every rank).

    Attributes:
        cached_central_plan: this rank's final plan of the latest save.
        cached_local_plan: this rank's local plan of the latest save.
        cached_global_metadata: the global metadata, on the coordinator (elsewhere
            whatever was set); a loaded checkpoint's metadata may be put here with
            :meth:`set_cached_global_metadata`.
        validated_cache_reuse: whether the latest save reused the cached plans.
        validated_loaded_metadata_reuse: whether the latest save reused the loaded
            checkpoint's metadata.
    """

    def __init__(self) -> None:
        self.cached_central_plan: Optional[SavePlan] = None
        self.cached_local_plan: Optional[SavePlan] = None
        self.cached_global_metadata: Optional[Metadata] = None
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False

    @property
    def loaded_all_plans(self) -> Optional[List[bytes]]:
        """The plan digests of the cached metadata (:func:`loaded_plans`), or None."""
        return loaded_plans(self.cached_global_metadata)

    def set_cached_global_metadata(self, cached_global_metadata: Optional[Metadata]) -> None:
        """Seed the cache with a loaded checkpoint's metadata (every rank).

        Its plan digests (written by our saver) let the first save of a resumed job skip
        the plan gather when every rank's plan matches. Cached plans are dropped: they were made
        with another metadata, which this one may not describe.
        """
        self.cached_global_metadata = cached_global_metadata
        self.cached_central_plan = self.cached_local_plan = None

    def get_cache_metadata(
        self,
    ) -> Tuple[Optional[SavePlan], Optional[SavePlan], bool, Optional[List[bytes]]]:
        """Return ``(central plan, local plan, validated_cache_reuse, loaded_all_plans)``."""
        return (
            self.cached_central_plan,
            self.cached_local_plan,
            self.validated_cache_reuse,
            self.loaded_all_plans,
        )

    def can_offer_cached_plans(self, is_coordinator: bool) -> bool:
        """Whether this rank may offer its cached plans for reuse (every rank, local).

        The coordinator offers them only while it holds the metadata that goes with
        them; otherwise it asks for a fresh plan, and with it every rank plans afresh.
        """
        if self.cached_central_plan is None:
            return False
        return self.cached_global_metadata is not None or not is_coordinator

    def prepare_save_state_dict_ret(self, rank: int, coordinator: int, save_state_dict_ret):
        """Fill the cached metadata into a planning result that reused it (every rank,
        once the save's plans and how they were made are recorded here).

        ``save_state_dict_ret`` is ``(writer, metadata or None, dist_wrapper)``. When the
        plans or the loaded metadata were reused, the coordinator's metadata is the
        cached one (None elsewhere). Otherwise the result's metadata is remembered on
        every rank, None off the coordinator, so that no rank later checks its plan
        against the digests of another save than the coordinator's.
        """
        writer, metadata, dist_wrapper = save_state_dict_ret
        if self.validated_cache_reuse or self.validated_loaded_metadata_reuse:
            metadata = self.cached_global_metadata if rank == coordinator else None
        else:
            self.cached_global_metadata = metadata
        return writer, metadata, dist_wrapper

