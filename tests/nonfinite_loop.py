"""examples/user_loop.py for the tests of non-finite losses: the same loop, whose loss is NaN
at the microbatch ids listed in RECOVER_TEST_NAN_IDS (comma-separated; unset: none)."""
import os

import torch

from recover.core import Replica

NAN_IDS = {int(i) for i in os.environ.get("RECOVER_TEST_NAN_IDS", "").split(",") if i.strip()}

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
replica = Replica.from_env(model, optimizer, lr_schedule=scheduler, grad_clip=1.0)


def batch(mb_id: int):
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(32, 16, generator=g)
    if mb_id in NAN_IDS:
        x[0, 0] = float("nan")  # one poisoned input: the loss and this microbatch's gradient are NaN
    return x, torch.sin(x.sum(dim=1, keepdim=True))


while not replica.done:
    for mb in replica.quota():
        x, y = batch(mb)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        replica.fold(mb, loss.item())
    replica.commit()
replica.close()
