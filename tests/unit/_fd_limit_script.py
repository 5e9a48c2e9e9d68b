"""Save many CPU tensors through the persistent worker under a low open-file limit."""

import os
import resource
import sys

import torch

from megatron_async.errors import AsyncSaveFailedError
from megatron_async.torch_ckpt import TorchAsyncCheckpoint


def main(out_dir: str, limit: int, num_tensors: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    state = {f"t{i}": torch.randn(8) for i in range(num_tensors)}
    ckpt = TorchAsyncCheckpoint(persistent_queue=True)
    try:
        ckpt.async_save(state, os.path.join(out_dir, "persistent.pt"))
        ckpt.finalize_async_save(blocking=True)
        print("persistent: saved")
    except AsyncSaveFailedError as exc:
        print("persistent: refused:", exc.failures[0].message)
    ckpt.close()
    with open(os.path.join(out_dir, "still-writable.txt"), "w") as f:  # no descriptors leaked
        f.write("ok")
    fallback = TorchAsyncCheckpoint(persistent_queue=False)
    fallback.async_save(state, os.path.join(out_dir, "temporal.pt"))
    fallback.finalize_async_save(blocking=True)
    fallback.close()
    print("temporal: saved", len(torch.load(os.path.join(out_dir, "temporal.pt"))))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
