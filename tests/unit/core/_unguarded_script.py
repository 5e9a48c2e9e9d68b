"""A training script WITHOUT an ``if __name__ == "__main__":`` guard that saves through the
persistent worker.

Usage: ``... OUT_DIR REPO_ROOT``. Every run of this top-level code appends its pid to
``OUT_DIR/top_level_runs``: the worker must never run it (it would build a second queue
and save again).
"""

import json
import os
import sys

out_dir, repo_root = sys.argv[1], sys.argv[2]
sys.path.insert(0, repo_root)
with open(os.path.join(out_dir, "top_level_runs"), "a") as f:
    f.write(f"{os.getpid()}\n")

import megatron_async  # noqa: E402
from megatron_async.core import AsyncCallsQueue, AsyncRequest  # noqa: E402
from tests import background_fns as fns  # noqa: E402
from tests.persistent_worker import wait_until_worker_ready  # noqa: E402

queue = wait_until_worker_ready(AsyncCallsQueue(persistent=True))
facts_path = os.path.join(out_dir, "worker_facts.json")
queue.schedule_async_request(AsyncRequest(fns.write_worker_facts, (facts_path, None, None), []))
queue.maybe_finalize_async_calls(blocking=True)
queue.schedule_async_request(AsyncRequest(fns.raise_error, (facts_path, None, "disk on fire"), []))
try:
    queue.maybe_finalize_async_calls(blocking=True)
except megatron_async.AsyncSaveFailedError as exc:
    print("failed save:", exc.rank_failures[0].message)
queue.close()

with open(facts_path) as f:
    facts = json.load(f)
print("trainer pid:", os.getpid())
print("worker pid:", facts["pid"])
