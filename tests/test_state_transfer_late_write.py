"""A receive abandoned in the newcomer's own storage really writes late, and is held in doubt until it ends.

Real fault: a donor process is SIGSTOPped by its PID while its large tensor is on the
wire; the newcomer (this test's process) abandons the transfer on its abort check
(as a coordinator's new generation makes it), and its parameter, where that tensor was
arriving in place, is then in doubt (`state_transfer._settled` is False). SIGCONT:
the donor's bytes arrive after the failure was raised, into the parameter (so the
rule is needed), and only then is the accumulator settled again
(core/worker/state_transfer.py, "Late writes"). The donor's process is killed by PID
whatever happens.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from recover.core.config.schedule import WarmupCosine
from recover.core.worker.accumulator import GradAccumulator
from recover.core.worker.comm import CollectiveError, Communicator
from recover.core.worker.recipe import CommittedStep
from recover.core.worker.state_transfer import _settled, transfer_state

pytestmark = pytest.mark.procs

WIDTH = 2048  # the large weight: 2048 x 4096 fp32, 32 MB, far more than a socket's buffers hold


def _replica(seed: int):
    """A model with one large weight, after one AdamW step (its moments exist: they arrive in place)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(WIDTH, 4096)
    acc = GradAccumulator(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepper = CommittedStep(opt, acc.params, WarmupCosine(max_lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10))
    model(torch.randn(2, WIDTH)).sum().backward()
    stepper(0)
    acc.clear()
    return acc, opt, stepper


def _donor(port: int, timeout: float) -> None:
    torch.set_num_threads(1)
    acc, opt, stepper = _replica(0)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
    comm = Communicator.build(lambda: client, 0, 0, 2, "gloo", timeout)
    transfer_state(comm, 0, acc, opt, stepper, timeout)  # it ends once the late bytes are through


@pytest.mark.timeout(120)
def test_a_receive_abandoned_in_place_writes_after_the_failure_and_stays_in_doubt_until_it_ends():
    timeout = 60.0
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    donor = mp.get_context("spawn").Process(target=_donor, args=(store.port, timeout), daemon=True)
    donor.start()
    try:
        acc, opt, stepper = _replica(1)
        weight = acc.params[0]
        where = weight.data_ptr()
        comm = Communicator.build(lambda: store, 0, 1, 2, "gloo", timeout)
        stopped: dict[str, float] = {}
        broadcasts = []

        def progress() -> None:
            broadcasts.append(1)
            if len(broadcasts) == 2:  # the header has arrived: the large tensor is what travels next
                os.kill(donor.pid, signal.SIGSTOP)
                stopped["at"] = time.monotonic()

        def should_abort():
            # the abort a new generation brings, once the donor has been stopped a while
            return "the donor was declared dead" if "at" in stopped and time.monotonic() - stopped["at"] > 0.3 else None

        with pytest.raises(CollectiveError, match="aborted"):
            transfer_state(comm, 0, acc, opt, stepper, timeout, should_abort, progress=progress)
        assert "at" in stopped
        assert not _settled(acc)  # the donor is alive and stopped: its bytes may still come
        before = weight.detach().clone()
        os.kill(donor.pid, signal.SIGCONT)
        deadline = time.monotonic() + timeout  # the abandoned receive's own backend timeout bounds it
        while not _settled(acc):
            assert time.monotonic() < deadline and donor.exitcode in (None, 0), donor.exitcode
            time.sleep(0.01)
        # the donor's bytes landed after the failure, in the parameter's own storage
        assert weight.data_ptr() == where and not torch.equal(weight.detach(), before)
        assert torch.equal(weight.detach(), _replica(0)[0].params[0].detach())
        donor.join(timeout)
        assert donor.exitcode == 0
    finally:
        if donor.is_alive():
            os.kill(donor.pid, signal.SIGCONT)
            donor.kill()
            donor.join(10)
