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
import sys

import torch

__all__ = ["bind_rank_to_gpu"]


def bind_rank_to_gpu(local_rank: int) -> int:
    """Make GPU ``local_rank % device_count`` current for this process and return its index."""
    count = torch.cuda.device_count()
    index = local_rank % count
    if local_rank >= count:
        print(f"[local rank {local_rank}] more local ranks than GPUs ({count}): sharing GPU "
              f"{index}; NCCL traffic between ranks on one GPU goes over its network "
              "transport (for tests; a training job wants one GPU per rank)", file=sys.stderr)
        os.environ.setdefault("NCCL_HOSTID", f"{socket.gethostname()}-gpu-share-{local_rank}")
    torch.cuda.set_device(index)
    return index
