"""For each case (a list of flags, all cases given as one JSON argument), save the
example's tiny GPT three times on one rank; print, as one JSON list with one entry per
case, which saves had megatron-core validate the sharding and which produced a complete
checkpoint (one bool per save in each list). One process runs every case: starting one
costs seconds."""

import json
import os
import shutil
import sys
import tempfile

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing import state_dict_utils

from megatron_async.checkpoint_dirs import is_complete_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "examples"))

from gpt import cpu_compat  # noqa: E402
from gpt.arguments import parse_args  # noqa: E402
from gpt.checkpointing import Checkpointer  # noqa: E402
from gpt.model import build_model, build_optimizer, resolve_transformer_impl, set_seed  # noqa: E402


def run_case(workdir, flags):
    """Three saves of a fresh model and checkpointer built from ``flags``."""
    args = parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                       "--seq-length", "16", "--train-iters", "3", "--save-interval", "1",
                       "--save", os.path.join(workdir, "ckpt"), *flags])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    args.transformer_impl = resolve_transformer_impl("auto")
    set_seed(args.seed)
    model = build_model(args)
    checkpointer = Checkpointer(args, model, build_optimizer(args, model))
    validated = []
    original = state_dict_utils.validate_sharding_integrity

    def counting(*a, **k):
        validated[-1] = True
        return original(*a, **k)

    state_dict_utils.validate_sharding_integrity = counting
    paths = []
    try:
        for iteration in (1, 2, 3):
            validated.append(False)
            paths.append(checkpointer.save(iteration, iteration).path)
            checkpointer.maybe_finalize(blocking=True)
    finally:
        state_dict_utils.validate_sharding_integrity = original
        checkpointer.close()
        parallel_state.destroy_model_parallel()
    return {"validated": validated, "complete": [is_complete_checkpoint(path) for path in paths]}


def main(cases):
    workdir = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=0, world_size=1)
    cpu_compat.install()
    results = []
    try:
        for index, flags in enumerate(cases):
            results.append(run_case(os.path.join(workdir, f"case{index}"), flags))
    finally:
        dist.destroy_process_group()
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
