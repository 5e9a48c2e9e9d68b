"""A two-rank training script WITHOUT an ``if __name__ == "__main__":`` guard whose save
routines (a function, a class whose instance is a request argument, a callable class)
are defined in the script itself. test_script_routines.py runs it as a file, through
``python -c``, from stdin and under torchrun.

Usage: ``... OUT_DIR REPO_ROOT`` on every rank, with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). The repository is put on ``sys.path``
here, not through ``PYTHONPATH``. Each rank saves twice with each caller: persistent with
a worker forked before the routines were defined (as Megatron-LM creates it), and
temporal. The routines write marker files in the
background; finalize functions (trainer side) write one more once every rank is done.
Every run of this top-level code appends its pid to ``OUT_DIR/top_level_runs``.
"""

import functools
import json
import os
import sys

out_dir, repo_root = sys.argv[1], sys.argv[2]
sys.path.insert(0, repo_root)
with open(os.path.join(out_dir, "top_level_runs"), "a") as f:
    f.write(f"{os.getpid()}\n")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_async  # noqa: E402
from megatron_async.core import AsyncCallsQueue, AsyncRequest  # noqa: E402
from tests.persistent_worker import wait_until_worker_ready  # noqa: E402

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
early_queue = AsyncCallsQueue(persistent=True)  # its worker is forked before the routines exist

MARKER_VERSION = "v1"


def marker_path(caller, routine, of_rank):
    return os.path.join(out_dir, f"{caller}-{routine}-rank{of_rank}.json")


class MarkerSpec:
    """A request argument: where a marker goes and how it is written."""

    def __init__(self, path):
        self.path = path

    def write(self, payload):
        payload.update(pid=os.getpid(), version=MARKER_VERSION)
        with open(self.path + ".tmp", "w") as f:
            json.dump(payload, f)
        os.replace(self.path + ".tmp", self.path)


def write_marker(spec, staged, note):
    """The background part: say who ran it, on which snapshot."""
    spec.write({"routine": "write_marker", "note": note, "staged": staged.tolist()})


class CallableWriter(MarkerSpec):
    """A callable class: an instance is the request's async_fn."""

    def __call__(self, _unused, staged, factor):
        self.write({"routine": "CallableWriter", "staged": (staged * factor).tolist()})


def stage(tensor):
    return tensor.clone()


def record_finalized(caller, routine):
    """Trainer side, after every rank's background part: read every rank's marker."""
    peers = [json.load(open(marker_path(caller, routine, r))) for r in range(world_size)]
    with open(marker_path(caller, routine, rank) + ".finalized", "w") as f:
        json.dump({"pid": os.getpid(), "peer_routines": [p["routine"] for p in peers]}, f)


def save_twice(queue, caller):
    weights = torch.arange(4.0) + 10 * rank
    spec = MarkerSpec(marker_path(caller, "function", rank))
    request = AsyncRequest(
        write_marker, (spec, None, f"{caller} rank {rank}"), [],
        preload_fn=functools.partial(stage, weights),
    )
    request.add_finalize_fn(functools.partial(record_finalized, caller, "function"))
    queue.schedule_async_request(request)
    weights.add_(1000)  # the next training step, right after scheduling
    queue.schedule_async_request(AsyncRequest(
        CallableWriter(marker_path(caller, "callable", rank)), (None, None, 2),
        [functools.partial(record_finalized, caller, "callable")],
        preload_fn=functools.partial(stage, weights),
    ))
    assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
    worker = queue.persistent_caller
    result = {"trainer_pid": os.getpid(), "worker_pid": worker.process.pid if worker else None}
    queue.close()
    return result


results = {"package_file": megatron_async.__file__}
results["fork"] = save_twice(wait_until_worker_ready(early_queue), "fork")
results["temporal"] = save_twice(AsyncCallsQueue(persistent=False), "temporal")
with open(os.path.join(out_dir, f"result-rank{rank}.json"), "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
