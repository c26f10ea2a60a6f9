"""examples/user_loop.py for the tests of failed state transfers: the same loop, whose optimizer
cannot be sent the first RECOVER_TEST_UNSENDABLE times (default 0) a state transfer reads it in
this process. Its state dict then carries a non-fp32 state tensor (an int64 counter), which the
transfer's layout code refuses with a TypeError on the donor: a transfer error that is not a
collective's, from the state itself, as a user's optimizer could cause."""
import os

import torch

from recover.core import Replica

UNSENDABLE = int(os.environ.get("RECOVER_TEST_UNSENDABLE", "0"))


class SometimesUnsendableSGD(torch.optim.SGD):
    reads = 0

    def state_dict(self):
        sd = super().state_dict()
        SometimesUnsendableSGD.reads += 1
        if SometimesUnsendableSGD.reads <= UNSENDABLE:
            sd["state"].setdefault(0, {})["updates"] = torch.zeros(1, dtype=torch.int64)
        return sd


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = SometimesUnsendableSGD(model.parameters(), lr=0.05)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
replica = Replica.from_env(model, optimizer, lr_schedule=scheduler, grad_clip=1.0)


def batch(mb_id: int):
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(32, 16, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


while not replica.done:
    for mb in replica.quota():
        x, y = batch(mb)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        replica.fold(mb, loss.item())
    replica.commit()
replica.close()
