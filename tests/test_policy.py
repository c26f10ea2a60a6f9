"""Quota policy (layer 3): partition, balance, makespan-optimality (hypothesis)."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.core.contract import idranges
from recover.core.contract.policy import (assign_quota_ranges, assign_quotas, equal_share, greedy_quota_sizes, makespan,
                                 quota_of, quota_sizes)

replica_sets = st.lists(st.integers(0, 63), min_size=1, max_size=12, unique=True)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 10**6), unique=True, max_size=200), replicas=replica_sets, data=st.data())
def test_quotas_always_partition_the_ids(ids, replicas, data):
    speeds = data.draw(st.one_of(st.none(), st.fixed_dictionaries(
        {r: st.floats(0.05, 20.0) for r in replicas})))
    q = assign_quotas(ids, replicas, speeds)
    assert set(q) == set(replicas)
    flat = [i for r in q for i in q[r]]
    assert sorted(flat) == sorted(ids) and len(flat) == len(set(flat))


@settings(max_examples=300, deadline=None)
@given(ids=st.sets(st.integers(0, 400), max_size=200), replicas=replica_sets, data=st.data())
def test_quota_ranges_are_the_quotas_written_as_ranges(ids, replicas, data):
    speeds = data.draw(st.one_of(st.none(), st.fixed_dictionaries({r: st.floats(0.05, 20.0) for r in replicas})))
    q = assign_quota_ranges(idranges.from_ids(ids), replicas, speeds)
    assert {r: idranges.to_ids(v) for r, v in q.items()} == assign_quotas(sorted(ids), replicas, speeds)


@settings(max_examples=300, deadline=None)
@given(ids=st.sets(st.integers(0, 400), max_size=200), replicas=replica_sets)
def test_each_members_equal_share_is_its_quota_of_the_whole_split(ids, replicas):
    """What a worker computes alone from a shared message is what the coordinator's
    split over all members would have handed it."""
    todo, members = idranges.from_ids(ids), idranges.from_ids(replicas)
    q = assign_quota_ranges(todo, replicas, None)
    for r in replicas:
        assert equal_share(todo, members, r) == q[r]
        assert quota_of({"t": "commit", "split": todo}, members, r) == q[r]
        assert quota_of({"t": "commit", "quota": [[7, 9]]}, members, r) == [[7, 9]]  # its own, as sent
    with pytest.raises(ValueError):
        equal_share(todo, members, max(replicas) + 1)  # not a member: no share
    with pytest.raises(ValueError):
        equal_share(todo, [], 0)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 500), replicas=replica_sets)
def test_equal_speeds_give_quotas_within_one(n, replicas):
    sizes = quota_sizes(n, replicas, {r: 2.5 for r in replicas})
    assert max(sizes.values()) - min(sizes.values()) <= 1
    assert sum(sizes.values()) == n


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 500), replicas=replica_sets, speed=st.one_of(st.none(), st.floats(0.05, 20.0)))
def test_equal_speeds_closed_form_is_the_greedy_split(n, replicas, speed):
    """The O(R) closed form for equal speeds gives exactly what the greedy gives."""
    speeds = None if speed is None else {r: speed for r in replicas}
    rate = {r: 1.0 if speed is None else speed for r in replicas}
    assert quota_sizes(n, replicas, speeds) == greedy_quota_sizes(n, replicas, rate)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 9), speeds=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=4))
def test_unequal_speeds_minimise_makespan_exhaustively(n, speeds):
    reps = list(range(len(speeds)))
    sp = dict(zip(reps, speeds))
    got = makespan(quota_sizes(n, reps, sp), sp)
    best = min(
        makespan(dict(zip(reps, split)), sp)
        for split in itertools.product(range(n + 1), repeat=len(reps))
        if sum(split) == n
    )
    assert got <= best * (1 + 1e-12)


def test_slow_replica_gets_less():
    sizes = quota_sizes(12, [0, 1, 2], {0: 1.0, 1: 1.0, 2: 0.25})
    assert sizes[2] < sizes[0] and sum(sizes.values()) == 12


def test_policy_refuses_no_replicas_or_bad_speed():
    with pytest.raises(ValueError, match="no live replicas"):
        assign_quotas([1, 2], [])
    with pytest.raises(ValueError, match="non-positive speed"):
        quota_sizes(3, [0, 1], {0: 1.0, 1: 0.0})
