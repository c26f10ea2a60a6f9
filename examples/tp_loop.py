"""Your own loop with tensor parallelism inside each replica, made resilient by recover.

Run it with 3 replicas of 2 tensor-parallel ranks each (6 processes) under the ReCoVer coordinator:

    .venv/bin/recover launch --replicas 3 --tp 2 --microbatches 6 --steps 20 --out runs/tp_loop -- \
        .venv/bin/python examples/tp_loop.py

Every rank runs this same file. torch's own DTensor tensor parallelism splits the
first layer's output features (ColwiseParallel) and the second layer's input features
(RowwiseParallel) over the replica's 2 tp ranks; both ranks see the whole microbatch,
and the replicas all-reduce per tp rank. Kill any one process (runs/tp_loop/pids.json
lists each replica's ranks): its whole replica goes, the other replicas redo its
microbatches, and the losses stay those of a run without the kill.
"""
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from recover.core import ReplicaContext, ShardedAccumulator

ctx = ReplicaContext.from_env()  # RECOVER_TP (from `recover launch --tp`): the replica's ("shard", "tp") grid
torch.manual_seed(0)  # every rank of every replica starts from the same full weights; TP keeps its slice
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
parallelize_module(model, ctx.parallel.tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
acc = ShardedAccumulator(model, mesh=ctx.mesh)  # .grad views this rank's slice of the replica's gradient sum
optimizer = torch.optim.AdamW(acc.params, lr=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))  # 5-step warm-up
replica = ctx.join(acc, optimizer, lr_schedule=scheduler, grad_clip=1.0)  # clips over the whole split gradient


def batch(mb_id: int):
    """Microbatch `mb_id`'s data: a function of its global id only."""
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(32, 16, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


while not replica.done:
    for mb in replica.quota():  # the same ids on every rank of the replica
        x, y, share = ctx.part(*batch(mb))  # the tp ranks of a shard position take the same rows (all, here)
        loss = torch.nn.functional.mse_loss(model(x), y) * share
        loss.backward()
        replica.fold(mb, loss.item())  # every tp rank folds; the replica's loss counts tp rank 0's
    replica.commit()  # per-position all-reduce across replicas, the leader's vote, the optimizer step
replica.close()
