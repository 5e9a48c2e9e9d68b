"""Which GPU a rank of the example uses (every rank, before the process group exists).

One rank per GPU is the normal case: local rank ``i`` takes GPU ``i``. A node with fewer
GPUs than local ranks (a test of a multi-rank NCCL job on a one-GPU workstation) shares
them round-robin. NCCL refuses two ranks of one communicator on one GPU of one host
("Duplicate GPU detected"), so each extra rank gets a host identity of its own
(``NCCL_HOSTID``): NCCL then treats the ranks as separate nodes and moves their traffic over
its network transport on this host. Slow, and only for tests; a real job has a GPU per rank.
"""

from __future__ import annotations

import os
import socket

import torch

__all__ = ["bind_rank_to_gpu"]


def bind_rank_to_gpu(local_rank: int) -> int:
    """Make GPU ``local_rank % device_count`` current for this process and return its index."""
    count = torch.cuda.device_count()
    if local_rank >= count and "NCCL_HOSTID" not in os.environ:
        os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-gpu-share-{local_rank}"
    index = local_rank % count
    torch.cuda.set_device(index)
    return index
