"""Every accumulator keeps the one interface a replica holds it by (core/worker/accumulator.py).

`Replica` used to tell accumulators apart with `hasattr` (has it a `pack`? a `wide_needed`?
an `out_of_range`?); now each keeps `Accumulator`, and the replica calls it plainly. Pure.
"""
from __future__ import annotations

import torch

from recover.core.worker.accumulator import Accumulator, GradAccumulator
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
