"""Train a tiny model of plain torch modules on 2 ranks, with async checkpoints.

    torchrun --nproc-per-node 2 examples/minimal_loop.py --save /tmp/minimal_ckpt

Run the same command again with a larger ``--train-iters``: it resumes from the latest
complete checkpoint. Read top to bottom: the process group and the background-save
queue, the model and its optimizer, their megatron-core sharded state dict (what to
write for your own model), resume, the loop that saves every ``--save-interval``
iterations and at the last one, and the final wait. CPU and gloo; the README's
"In a training loop" shows the loop's lines.
"""

import argparse
import logging
from collections import OrderedDict

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

import megatron_async
from megatron_async.manager import CheckpointManager, CheckpointManagerConfig

parser = argparse.ArgumentParser(description="a tiny training loop with async checkpoints")
parser.add_argument("--save", required=True, help="directory of the iter_* checkpoints")
parser.add_argument("--train-iters", type=int, default=20)
parser.add_argument("--save-interval", type=int, default=5)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
logging.basicConfig(format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
logging.getLogger("megatron_async").setLevel(logging.INFO)  # each save, and when it is durable

# The queue before the model: its persistent worker shares none of the model's memory.
queue = megatron_async.AsyncCallsQueue(persistent=True)
strategy = megatron_async.TorchDistAsyncSaveStrategy()
# Creates --save if it is missing and fails here, on every rank, if it cannot be written.
manager = CheckpointManager(CheckpointManagerConfig(save_dir=args.save, load_dir=args.save))

# fc1 is split by rows across the ranks (each holds 32 of the 32 * world_size rows, like a
# tensor-parallel slice); fc2 is replicated (data parallel: its gradients are averaged).
torch.manual_seed(0)
model = torch.nn.Sequential(OrderedDict(
    fc1=torch.nn.Linear(8, 32), act=torch.nn.ReLU(), fc2=torch.nn.Linear(32, 1)))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)


def sharded(key, tensor):
    """This rank's part of ``key`` as megatron-core's ShardedTensor."""
    if ".fc1." in key:  # chunk `rank` of `world_size` along dim 0; every rank writes its own
        return ShardedTensor.from_rank_offsets(key, tensor, (0, rank, world_size), replica_id=0)
    return ShardedTensor.from_rank_offsets(key, tensor, replica_id=rank)  # rank 0 writes it


def sharded_state_dict(iteration):
    """Model and optimizer for dist_checkpointing.save; before the first optimizer step
    (a fresh process) Adam's moments are zeros: then it is the template to load into."""
    state = {"iteration": iteration, "model": {}, "optimizer": {}}  # plain values: common.pt
    for name, param in model.named_parameters():
        adam = optimizer.state[param]
        state["model"][name] = sharded(f"model.{name}", param.detach())
        state["optimizer"][name] = {"step": int(adam.get("step", 0))}
        for moment in ("exp_avg", "exp_avg_sq"):
            moment_value = adam.get(moment, torch.zeros_like(param))
            state["optimizer"][name][moment] = sharded(f"optimizer.{name}.{moment}", moment_value)
    return state


def train_step(iteration):
    """One step on this rank's batch (drawn from the iteration: a resume sees the same data)."""
    batch = torch.Generator().manual_seed(1000 * iteration + rank)
    x = torch.randn(16, 8, generator=batch)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    for param in model.fc2.parameters():  # replicated: keep it the same on every rank
        dist.all_reduce(param.grad)
        param.grad /= world_size
    optimizer.step()
    return loss.item()


# Resume from the latest complete checkpoint (rank 0 chooses; every rank gets its choice).
start = 0
point = manager.find_resume_point()
if point is not None:
    loaded = dist_checkpointing.load(sharded_state_dict(0), point.path)
    model.load_state_dict(loaded["model"])
    for name, param in model.named_parameters():
        adam = loaded["optimizer"][name]
        optimizer.state[param] = dict(adam, step=torch.tensor(float(adam["step"])))
    start = loaded["iteration"]
    print(f"[rank {rank}] resumed from {point.path} at iteration {start}", flush=True)

for iteration in range(start + 1, args.train_iters + 1):  # iteration = steps done after it
    queue.maybe_finalize_async_calls(blocking=False)  # every rank, every iteration
    loss = train_step(iteration)
    if iteration % args.save_interval == 0 or iteration == args.train_iters:
        path = manager.prepare_save(iteration)  # <save>/iter_0000005, new and empty
        request = dist_checkpointing.save(sharded_state_dict(iteration), path,
                                          sharded_strategy=strategy, async_sharded_save=True)
        manager.attach_commit(request, iteration)  # the tracker moves once it is durable
        queue.schedule_async_request(request)  # returns once the state is staged
        if rank == 0:
            print(f"iteration {iteration}: loss {loss:.4f}, saving {path}", flush=True)
queue.close()  # finalizes what is left, stops the worker
dist.destroy_process_group()
