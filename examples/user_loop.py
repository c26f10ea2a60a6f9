"""A complete training loop of your own, made resilient by recover.core.Replica.

Run it with 4 replicas (one process each) under the ReCoVer coordinator:

    .venv/bin/recover launch --replicas 4 --microbatches 8 --steps 30 --out runs/user_loop -- \
        .venv/bin/python examples/user_loop.py

Kill any of its worker processes while it runs (the PIDs are in runs/user_loop/pids.json):
the others redo that replica's microbatches and the run finishes with the same losses.
"""
import torch

from recover.core import Replica

torch.manual_seed(0)  # every replica starts from the same weights
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
# Any torch LR scheduler (or a function of the step: lr_schedule=lambda step: ...).
# The replica steps it only when a step commits, so a step redone after a failure
# keeps its learning rate; grad_clip clips the committed (averaged) gradient.
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))  # 5-step warm-up
replica = Replica.from_env(model, optimizer, lr_schedule=scheduler, grad_clip=1.0)


def batch(mb_id: int):
    """Microbatch `mb_id`'s data: a function of its global id only."""
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(32, 16, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


while not replica.done:
    for mb in replica.quota():  # this replica's ids; after a failure, the dead one's
        x, y = batch(mb)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # accumulates into the replica's gradient buffer
        replica.fold(mb, loss.item())
    replica.commit()  # fault-tolerant all-reduce, vote, optimizer step (False: redo needed)
replica.close()
