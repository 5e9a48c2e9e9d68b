"""Save many CPU tensors through the persistent worker under a low open-file limit."""

import os
import resource
import sys

import torch

from megatron_async.torch_ckpt import TorchAsyncCheckpoint
from tests.persistent_worker import wait_until_worker_ready


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def main(out_dir: str, limit: int, num_tensors: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    state = {f"t{i}": torch.randn(8) for i in range(num_tensors)}
    expected = {k: v.clone() for k, v in state.items()}
    ckpt = TorchAsyncCheckpoint(persistent_queue=True)
    wait_until_worker_ready(ckpt._queue)  # the tensors must travel to the worker
    for step in range(2):
        path = os.path.join(out_dir, f"persistent{step}.pt")
        ckpt.async_save(state, path)
        for tensor in state.values():
            tensor.add_(1.0)  # the next training step, while the write runs
        ckpt.finalize_async_save(blocking=True)
        loaded = torch.load(path)
        assert all(torch.equal(loaded[k], expected[k]) for k in expected), "wrong data"
        expected = {k: v.clone() for k, v in state.items()}
    print("persistent: saved", len(loaded), "tensors twice")
    print("trainer tensors moved to shared memory:", sum(t.is_shared() for t in state.values()))
    print("descriptors open:", _open_descriptors())
    ckpt.close()
    with open(os.path.join(out_dir, "still-writable.txt"), "w") as f:  # no descriptors leaked
        f.write("ok")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
