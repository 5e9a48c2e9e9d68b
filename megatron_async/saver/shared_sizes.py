"""One ``torch.Size`` object per distinct shape and offset in a local plan (every rank).

A local plan holds three or four ``torch.Size`` values per item (the item's offset, its
chunk's offsets and sizes, the whole tensor's size) and DCP builds each as a new object.
Pickle shares an object it has already written (one memo reference) but pickles every
new one in full, and a ``torch.Size`` is one of the slowest things to pickle (its reduce
goes through Python: about 2 us, against nothing for a repeated reference). In a model,
the same shapes and offsets recur from layer to layer, so after :func:`share_equal_sizes`
each rank's plan pickles a few dozen sizes instead of thousands. What is built from these
objects inherits the sharing: the plan gather, the global metadata's chunks, the write
results (their index is the item's; ``ChecksummedWriteResult`` pickles the offset object
itself), the results gather, and the coordinator's ``.metadata`` pickle of the first save
(docs/benchmarks.md, "Shared sizes").

Values do not change, only which object holds them (``torch.Size`` is immutable), so
plans compare, digest and load exactly as before. Only values that are ``torch.Size``
objects are shared (a tuple equal to one stays a tuple). DCP's plan dataclasses are
frozen: the fields are set with ``object.__setattr__``, as their own ``__init__`` does.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch.distributed.checkpoint.planner import SavePlan

__all__ = ["share_equal_sizes"]


def share_equal_sizes(plan: SavePlan) -> SavePlan:
    """Make equal ``torch.Size`` values of ``plan``'s items one object; return ``plan``.

    Every rank, on its own local plan, before it is gathered; changes it in place.
    """
    shared: Dict[torch.Size, torch.Size] = {}
    for item in plan.items:
        _share(item.index, "offset", shared)
        data = item.tensor_data
        if data is None:
            continue
        _share(data, "size", shared)
        if data.chunk is not None:  # a plan without one is refused by global planning
            _share(data.chunk, "offsets", shared)
            _share(data.chunk, "sizes", shared)
    return plan


def _share(owner: Any, field: str, shared: Dict[torch.Size, torch.Size]) -> None:
    value = getattr(owner, field, None)
    if type(value) is torch.Size:
        object.__setattr__(owner, field, shared.setdefault(value, value))
