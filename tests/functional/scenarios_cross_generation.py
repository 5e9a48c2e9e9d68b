"""Checkpoints crossing megatron-core generations: one rank job per interpreter.

``save`` and ``load`` run on 2 gloo ranks under whatever megatron-core the interpreter has
(0.16.x keeps the common state in ``common.pt``, 0.17+ inside the DCP files as the
``common_state`` object). ``python -m tests.functional.scenarios_cross_generation MODE
DIR`` runs one of them and prints what each rank found as JSON, so a test can drive the
other generation's interpreter.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_async.core import AsyncCallsQueue
from megatron_async.mcore import generation
from megatron_async.mcore.strategy import TorchDistAsyncSaveStrategy
from tests.functional.harness import RankContext, launch
from tests.functional.scenarios_strategy import _assert_equal_states, _load_dcp, _global_tensors, _model_state

SCALE = 6.0


def save(ctx: RankContext) -> dict:
    """Save the scenario state asynchronously with our strategy (every rank)."""
    path = ctx.options["path"]
    queue = AsyncCallsQueue(persistent=False)
    request = dist_checkpointing.save(
        _model_state(ctx, SCALE), path, sharded_strategy=TorchDistAsyncSaveStrategy(),
        async_sharded_save=True,
    )
    queue.schedule_async_request(request)
    queue.close()
    dist.barrier()
    return {"generation": generation.GENERATION}


def load(ctx: RankContext) -> dict:
    """Load with stock megatron-core and with plain DCP; report each outcome (every rank)."""
    path = ctx.options["path"]
    found = {"generation": generation.GENERATION}
    try:
        loaded = dist_checkpointing.load(_model_state(ctx, 0.0), path)
        _assert_equal_states(loaded, _model_state(ctx, SCALE), "megatron")
        found["megatron"] = "equal"
    except Exception as exc:  # reported to the test, which knows what each direction allows
        found["megatron"] = f"{type(exc).__name__}: {exc}"
    whole = _load_dcp(path, ctx.world_size)
    import torch

    found["dcp"] = (
        "equal"
        if all(torch.equal(whole[k], t) for k, t in _global_tensors(ctx.world_size, SCALE).items())
        else "different"
    )
    return found


def main(argv) -> int:
    mode, path = argv
    with tempfile.TemporaryDirectory() as tmp:
        results = launch(f"{__name__}:{mode}", 2, tmp, timeout_s=240, options={"path": path})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
