"""The ledger's bookkeeping is linear in the quota and keeps its behaviour.

`GradAccumulator` keeps a set beside its ordered ledger list, and `Replica` one beside
its quota, so membership checks are O(1). What must not change: the ledger's order,
the refusal of an id folded twice, `clear()` emptying both, and `Replica`'s
quota()/fold() bookkeeping (a folded id is not handed out again, a refused fold
discards the iteration's folds and lists them again). Speed is measured outside the
tests (the commit message gives the numbers); nothing here asserts on time.

The Replica here is built without processes: only the attributes that quota(),
fold() and the commit's pre-check read are set.
"""
from __future__ import annotations

import threading

import time

import pytest
import torch

from recover.core.worker.accumulator import GradAccumulator
from recover.core.contract.nonfinite import NonfiniteLosses
from recover.core.worker.progress import ProgressMeter
from recover.core.worker.replica import Replica


def _acc() -> GradAccumulator:
    return GradAccumulator([torch.nn.Parameter(torch.zeros(3))])


def test_accumulator_ledger_keeps_order_refuses_twice_and_clears():
    acc = _acc()
    for i in [7, 3, 9, 1]:
        acc.fold(i, 1.0)
    assert acc.ledger == [7, 3, 9, 1]
    assert acc.has(3) and not acc.has(4)
    assert acc.loss_sum == 4.0
    with pytest.raises(ValueError, match="folded twice"):
        acc.fold(9, 1.0)
    assert acc.ledger == [7, 3, 9, 1]
    acc.clear()
    assert acc.ledger == [] and not acc.has(7)
    acc.fold(7, 2.0)  # a new iteration may fold it again
    assert acc.ledger == [7]


class _Control:
    def abort_reason(self, gen):
        return None


def _replica(quota: range) -> Replica:
    r = object.__new__(Replica)
    r.acc, r.link, r._nonfinite, r.control = _acc(), None, NonfiniteLosses(), _Control()
    r.generation, r.step, r.steps, r.microbatches, r._abort = 0, 0, 1, len(quota), None
    r.replica, r.meter = 0, ProgressMeter()
    r._reconnect_lock = threading.Lock()  # quota() marks the replica working under it
    r._set_quota([[quota.start, quota.stop]])
    return r


def test_replica_quota_skips_what_is_folded_and_refusals_relist_the_folds():
    r = _replica(range(10, 20))
    for i in [12, 10]:
        r.fold(i, 0.5)
    assert list(r.quota()) == [11, 13, 14, 15, 16, 17, 18, 19]  # folded ids are not handed out again
    assert r._still_to_fold() == [11, 13, 14, 15, 16, 17, 18, 19]
    with pytest.raises(ValueError, match="folded twice"):
        r.fold(12, 0.5)
    # the refusal discarded both folds: they come first, then the rest of the quota, each once
    assert r.ledger == [] and r._quota == [12, 10, 11, 13, 14, 15, 16, 17, 18, 19]
    with pytest.raises(ValueError, match="not in this replica's quota"):
        r.fold(99, 0.5)
    for i in r.quota():
        r.fold(i, 0.5)
    assert r.ledger == [12, 10, 11, 13, 14, 15, 16, 17, 18, 19] and r._still_to_fold() == []


def test_a_large_quota_folds_whole_and_in_order():
    q = 4096
    r = _replica(range(q, 2 * q))
    r._work_started = time.perf_counter()
    for i in r.quota():
        r.fold(i, 0.5)
    assert r.ledger == list(range(q, 2 * q)) and r._still_to_fold() == []
