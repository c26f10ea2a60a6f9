"""Your own loop with FSDP2 inside each replica (HSDP), made resilient by recover.

Run it with 3 replicas of 2 ranks each (6 processes) under the ReCoVer coordinator:

    .venv/bin/recover launch --replicas 3 --shard 2 --microbatches 6 --steps 20 --out runs/hsdp_loop -- \
        .venv/bin/python examples/hsdp_loop.py

Every rank runs this same file. FSDP2 shards the model over a replica's ranks; each
rank takes its rows of every microbatch; the replicas all-reduce per shard. Kill any
one process (runs/hsdp_loop/pids.json lists each replica's ranks): its whole replica
goes, the other replicas redo its microbatches, and the losses stay those of a run
without the kill.
"""
import torch

from recover.core import ReplicaContext, ShardedAccumulator, shard_model

ctx = ReplicaContext.from_env()  # this rank's replica group, and its leader's relay
torch.manual_seed(0)  # every rank of every replica starts from the same weights
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
shard_model(model, ctx.mesh, layers=[model[0], model[2]])  # FSDP2 over the replica's ranks
acc = ShardedAccumulator(model)  # .grad views this rank's shard of the replica's gradient sum
optimizer = torch.optim.AdamW(acc.params, lr=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))  # 5-step warm-up
replica = ctx.join(acc, optimizer, lr_schedule=scheduler, grad_clip=1.0)


def batch(mb_id: int):
    """Microbatch `mb_id`'s data: a function of its global id only."""
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(32, 16, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


while not replica.done:
    for mb in replica.quota():  # the same ids on every rank of the replica
        x, y, share = ctx.part(*batch(mb))  # this rank's rows, and their share of the microbatch
        loss = torch.nn.functional.mse_loss(model(x), y) * share
        loss.backward()
        replica.fold(mb, loss.item())  # this rank's part of the microbatch's loss
    replica.commit()  # per-shard all-reduce across replicas, the leader's vote, the optimizer step
replica.close()
