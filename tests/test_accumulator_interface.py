"""Every accumulator keeps the one interface a replica holds it by (core/worker/accumulator_interface.py).

`Replica` used to tell accumulators apart with `hasattr` (has it a `pack`? a `wide_needed`?
an `out_of_range`?); now each keeps `Accumulator`, and the replica calls it plainly. Pure.
"""
from __future__ import annotations

import torch

import pytest

from recover.core.parallel.fsdp import ExactShardedAccumulator, ShardedAccumulator
from recover.core.worker.accumulator import GradAccumulator
from recover.core.worker.accumulator_interface import Accumulator
from recover.core.worker.exact import ExactAccumulator


def _params():
    torch.manual_seed(0)
    return list(torch.nn.Linear(3, 2).parameters())


def test_the_plain_and_the_exact_accumulator_keep_the_interface():
    for acc in (GradAccumulator(_params()), ExactAccumulator(_params(), microbatches=4)):
        assert isinstance(acc, Accumulator)
        buf = acc.pack()
        assert acc.wide_needed(buf) in (False, True)
        assert acc.out_of_range == {}
    assert not isinstance(_params(), Accumulator)  # parameters: the replica builds a GradAccumulator


def test_the_plain_accumulator_never_needs_a_wide_reduction_and_reads_the_loss_slot():
    acc = GradAccumulator(_params())
    acc.fold(7, 2.5)
    buf = acc.pack()
    assert acc.wide_needed(buf) is False and acc.reduced_loss_sum(buf) == 2.5


def test_every_kind_has_every_method_of_the_interface_so_no_caller_probes():
    # the sharded kinds need a process group to build; their methods are the class's own
    methods = [n for n, v in vars(Accumulator).items() if callable(v) and not n.startswith("_")]
    assert {"load_shard_mean", "pack_wide", "load_mean", "weights_bit_sums"} <= set(methods)
    for kind in (GradAccumulator, ExactAccumulator, ShardedAccumulator, ExactShardedAccumulator):
        missing = [n for n in methods if not callable(getattr(kind, n, None))]
        assert not missing, f"{kind.__name__} lacks {missing}"


def test_the_plain_accumulators_declare_torchs_clipping_and_no_wide_sums():
    acc = GradAccumulator(_params())
    assert acc.grad_norm_clipper is None
    assert ExactAccumulator(_params(), microbatches=4).grad_norm_clipper is None
    with pytest.raises(RuntimeError, match="no wide sums"):
        acc.pack_wide()
    with pytest.raises(ValueError, match="no wide sums"):
        acc.load_mean(acc.pack(), 2, torch.zeros(3))


@pytest.mark.parametrize("kind", ["fp32", "exact"])
def test_load_shard_mean_sets_the_gradients_load_mean_sets(kind):
    """The commit of a rank whose replica's combine carried the loss takes `load_shard_mean`
    (core/worker/replica.py `load_reduced`), whatever the accumulator; the gradients must be
    load_mean's bit for bit (an exact one's int64 sums converted, never read as fp32)."""
    def make():
        return GradAccumulator(_params()) if kind == "fp32" else ExactAccumulator(_params(), microbatches=4)
    grads = []
    for load in ("load_mean", "load_shard_mean"):
        acc = make()
        for i in range(2):
            for p in acc.params:
                p.grad.add_(torch.full_like(p, 0.25 * (i + 1)))
            acc.fold(i, 1.5)
        reduced = acc.pack()
        getattr(acc, load)(reduced, 4)
        grads.append([p.grad.clone() for p in acc.params])
    for mean, shard in zip(*grads):
        assert torch.equal(mean, shard)
        assert torch.allclose(mean, torch.full_like(mean, 0.75 / 4))
