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
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from recover.core.worker.accumulator import GradAccumulator
from recover.core.worker.comm import CollectiveError, Communicator
from recover.core.worker.recipe import CommittedStep
from recover.core.config.schedule import WarmupCosine
from recover.core.worker.state_transfer import (DIRECT_BYTES, _decode, _encode, _in_doubt, _settled,
                                                transfer_state)


def _replica(seed: int, width: int = 600):
    torch.manual_seed(seed)
    # one weight of 1.4 MB (over DIRECT_BYTES) and a few small tensors
    model = torch.nn.Sequential(torch.nn.Linear(600, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))
    acc = GradAccumulator(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    stepper = CommittedStep(opt, acc.params, WarmupCosine(max_lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10))
    return model, acc, opt, stepper


def _trained(seed: int = 0):
    model, acc, opt, stepper = _replica(seed)
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


def _heal(direct_bytes: int, receiver=None):
    donor, receiver = _trained(), receiver or _replica(1)
    stats, errors = _exchange(donor, receiver, direct_bytes=direct_bytes)
    assert not errors, {r: repr(e) for r, e in errors.items()}
    return donor, receiver, stats


def _holds_donors_state(donor, receiver) -> None:
    (_, dacc, dopt, dstep), (_, racc, ropt, rstep) = donor, receiver
    assert all(torch.equal(a, b) for a, b in zip(dacc.params, racc.params))
    dsd, rsd = dopt.state_dict(), ropt.state_dict()
    for idx, state in dsd["state"].items():
        for key, value in state.items():
            assert torch.equal(rsd["state"][idx][key], value), (idx, key)
    assert rstep.state_dict() == dstep.state_dict()


def _storage(replica) -> dict[str, int]:
    """Where each large tensor of a replica lives (its parameters', its optimizer moments')."""
    _, acc, opt, _ = replica
    where = {f"param{i}": p.data_ptr() for i, p in enumerate(acc.params) if 4 * p.numel() >= DIRECT_BYTES}
    for i, p in enumerate(acc.params):
        for key, t in opt.state.get(p, {}).items():
            if t.dim() and 4 * t.numel() >= DIRECT_BYTES:
                where[f"param{i}.{key}"] = t.data_ptr()
    return where


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


def test_a_receiver_that_has_stepped_receives_the_large_tensors_in_its_own_storage():
    """Its parameters and its AdamW moments exist: the large ones arrive where they live (no
    fresh memory, no copy), and it holds the donor's state bit for bit, checked."""
    receiver = _trained(1)
    before = _storage(receiver)
    assert len(before) == 3  # the 1.4 MB weight and its two moments
    donor, receiver, stats = _heal(DIRECT_BYTES, receiver)
    assert _storage(receiver) == before
    _holds_donors_state(donor, receiver)
    assert stats[0].fingerprint == stats[1].fingerprint == receiver[1].weights_fingerprint()


class _Abandoned:
    """A receive a failed transfer left in the backend (pure logic: the backend's work handle
    answers `is_completed()`); `end()` is the backend finishing it."""

    def __init__(self, on_end=None):
        self.ended, self.on_end = threading.Event(), on_end

    def end(self) -> None:
        if self.on_end is not None:
            self.on_end()
        self.ended.set()

    def is_completed(self) -> bool:
        return self.ended.is_set()


def test_while_an_abandoned_receive_may_still_write_the_next_transfer_keeps_out_of_the_live_storage():
    """An earlier transfer's receive into this replica's own storage was abandoned and has not
    ended (it may still write there): the next transfer receives into fresh memory, copies into
    the parameters only once that receive has ended, and is whole; the one after it is in place."""
    donor, receiver = _trained(), _trained(1)
    acc = receiver[1]
    before = _storage(receiver)
    old = [p.detach().clone() for p in acc.params]
    untouched_while_pending = []
    abandoned = _Abandoned(on_end=lambda: untouched_while_pending.append(
        all(torch.equal(a, b) for a, b in zip(old, acc.params))))
    _in_doubt(acc, [abandoned], time.monotonic() + 30)
    assert not _settled(acc)
    threading.Timer(1.0, abandoned.end).start()
    stats, errors = _exchange(donor, receiver)
    assert not errors, {r: repr(e) for r, e in errors.items()}
    assert untouched_while_pending == [True]  # nothing was copied in before it ended
    _holds_donors_state(donor, receiver)
    moved = _storage(receiver)
    assert moved["param0"] == before["param0"]  # a parameter keeps its storage (copied into)
    assert all(moved[k] != before[k] for k in before if "." in k)  # the moments arrived fresh
    assert _settled(acc)
    stats, errors = _exchange(donor, receiver)
    assert not errors and _storage(receiver) == moved  # settled: in place again


def test_an_abandoned_receive_that_outlives_its_backend_timeout_fails_the_transfer_not_the_donor():
    donor, receiver = _trained(), _trained(1)
    acc = receiver[1]
    old = [p.detach().clone() for p in acc.params]
    _in_doubt(acc, [_Abandoned()], time.monotonic() - 60)  # its backend timeout is long past
    stats, errors = _exchange(donor, receiver)
    assert isinstance(errors.get(1), CollectiveError) and "abandoned" in str(errors[1])
    assert 0 in stats  # the donor sent everything and went on
    assert all(torch.equal(a, b) for a, b in zip(old, acc.params))  # nothing was copied in


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
