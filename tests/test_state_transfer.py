"""Live state transfer (core/worker/state_transfer.py) between two gloo ranks in one process, no worker processes.

A donor that has trained (AdamW moments and step exist, the schedule has moved)
heals a fresh receiver over a real gloo `Communicator` (two threads, one
TCPStore on a free port). Checked bit for bit: the parameters, every optimizer
state tensor and number, the committed-step state; with every tensor in the one
buffer, with the large ones sent from their own storage (`direct_bytes`), and
with all of them sent so. A receiver built another way refuses from the header
and the donor's wait ends at its deadline. The header's JSON codec round-trips what optimizers
keep (tuples, int-keyed dicts, 0-d tensors, inf) exactly and refuses the rest.
"""
from __future__ import annotations

import math
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from recover.core.worker.accumulator import GradAccumulator
from recover.core.worker.comm import CollectiveError, Communicator
from recover.core.worker.recipe import CommittedStep
from recover.core.config.schedule import WarmupCosine
from recover.core.worker.state_transfer import DIRECT_BYTES, _decode, _encode, transfer_state


def _replica(seed: int, width: int = 600):
    torch.manual_seed(seed)
    # one weight of 1.4 MB (over DIRECT_BYTES) and a few small tensors
    model = torch.nn.Sequential(torch.nn.Linear(600, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))
    acc = GradAccumulator(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    stepper = CommittedStep(opt, acc.params, WarmupCosine(max_lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10))
    return model, acc, opt, stepper


def _trained():
    model, acc, opt, stepper = _replica(0)
    for step in range(3):
        model(torch.randn(5, 600)).sum().backward()
        stepper(step)
        acc.clear()
    return model, acc, opt, stepper


def _exchange(donor, receiver, timeout: float = 30.0, **kw):
    """Run transfer_state on two gloo ranks (threads); (stats by rank, errors by rank)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    port, stats, errors = store.port, {}, {}

    def side(rank: int, replica) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
            comm = Communicator.build(lambda: client, 0, rank, 2, "gloo", timeout)
            _, acc, opt, stepper = replica
            stats[rank] = transfer_state(comm, 0, acc, opt, stepper, timeout, **kw)
        except Exception as e:  # reported by the caller
            errors[rank] = e

    threads = [threading.Thread(target=side, args=(r, rep)) for r, rep in ((0, donor), (1, receiver))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return stats, errors


def _heal(direct_bytes: int):
    donor, receiver = _trained(), _replica(1)
    stats, errors = _exchange(donor, receiver, direct_bytes=direct_bytes)
    assert not errors, {r: repr(e) for r, e in errors.items()}
    return donor, receiver, stats


@pytest.mark.parametrize("direct_bytes", [1 << 40, DIRECT_BYTES, 0], ids=["one-buffer", "large-direct", "all-direct"])
def test_the_receiver_holds_the_donors_state_bit_for_bit(direct_bytes):
    (_, dacc, dopt, dstep), (_, racc, ropt, rstep), stats = _heal(direct_bytes)
    for a, b in zip(dacc.params, racc.params):
        assert torch.equal(a, b)
    dsd, rsd = dopt.state_dict(), ropt.state_dict()
    assert dsd["param_groups"] == rsd["param_groups"]
    assert sorted(dsd["state"]) == sorted(rsd["state"])
    for idx, state in dsd["state"].items():
        for key, value in state.items():
            got = rsd["state"][idx][key]
            assert got.dtype == value.dtype and torch.equal(got, value), (idx, key)
    assert rstep.state_dict() == dstep.state_dict() and rstep.committed == 3
    assert stats[0].fingerprint == stats[1].fingerprint == racc.weights_fingerprint()
    # the bytes moved: the weights and both AdamW moments (3x the weights), plus the header
    n = sum(p.numel() for p in dacc.params)
    assert 12 * n < stats[1].bytes < 12 * n + 64_000 and stats[0].bytes == stats[1].bytes
    # the receiver goes on as the donor does: one more identical step on both gives equal weights
    for acc, opt, stepper, seed in ((dacc, dopt, dstep, 7), (racc, ropt, rstep, 7)):
        torch.manual_seed(seed)
        g = [torch.randn_like(p) for p in acc.params]
        for p, gi in zip(acc.params, g):
            p.grad.copy_(gi)
        stepper(3)
    for a, b in zip(dacc.params, racc.params):
        assert torch.equal(a, b)


def test_a_receiver_built_another_way_refuses_the_state_and_the_donor_is_not_held():
    """A receiver whose model differs from the donor's refuses from the header, before any state
    arrives; the donor's wait for it ends at the deadline (CollectiveError), not in a hang."""
    other = _replica(1, width=601)
    acc = other[1]
    before = [p.detach().clone() for p in acc.params]
    stats, errors = _exchange(_trained(), other, timeout=3.0)
    assert not stats
    assert isinstance(errors[1], ValueError) and "every replica must build its model" in str(errors[1])
    assert isinstance(errors[0], CollectiveError)
    assert all(torch.equal(a, b) for a, b in zip(before, acc.params))  # nothing was loaded


def test_the_header_codec_round_trips_what_optimizers_keep():
    obj = {"state": {0: {"step": torch.tensor(3.0)}, 7: {"n": torch.tensor(5, dtype=torch.int64)}},
           "param_groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "params": [0, 7], "maximize": False,
                             "foreach": None, "clip": math.inf}], "__odd": "key"}
    back = _decode(_encode(obj))
    assert back["state"][0]["step"].dtype == torch.float32 and back["state"][0]["step"].item() == 3.0
    assert back["state"][7]["n"].dtype == torch.int64 and back["state"][7]["n"].item() == 5
    assert back["param_groups"] == obj["param_groups"] and isinstance(back["param_groups"][0]["betas"], tuple)
    assert back["__odd"] == "key"
    with pytest.raises(TypeError):
        _encode({"x": torch.zeros(3)})  # a tensor with dimensions belongs in the buffer, not the header
    with pytest.raises(ValueError):
        _decode({"__tensor": 1, "dtype": "not_a_dtype"})
