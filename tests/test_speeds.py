"""core/coordinator/speeds.py against the plain dict version beside it (hypothesis), and its readers."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.core.coordinator.speeds import SpeedTable, measure, plain_update, slowest_of

R = 12
steps = st.lists(st.dictionaries(st.integers(0, R - 1), st.floats(0.01, 50.0), max_size=R), max_size=6)


@settings(max_examples=300, deadline=None)
@given(steps=steps)
def test_the_array_update_is_the_plain_one_to_the_bit(steps):
    table, plain = SpeedTable(R, 0.2), {}
    for seconds in steps:
        who, measured, slowest = measure(seconds)
        assert slowest == (max(seconds.values()) if seconds else 0.0)
        assert dict(zip(who.tolist(), measured.tolist())) == {r: 1.0 / s for r, s in seconds.items()}
        table.update(who, measured)
        plain_update(plain, {r: 1.0 / s for r, s in seconds.items()}, 0.2)
    assert table.of(range(R)) == plain  # bit-equal floats, and unknown where never measured
    for r in range(R):
        assert table.get(r, -1.0) == plain.get(r, -1.0)
    known_all, lo, hi = table.spread(range(R))
    assert known_all == (len(plain) == R)
    if plain:
        assert (lo, hi) == (min(plain.values()), max(plain.values()))
    else:
        assert math.isnan(lo) and math.isnan(hi)


@settings(max_examples=300, deadline=None)
@given(seconds=st.dictionaries(st.integers(0, R - 1), st.sampled_from([0.1, 0.2, 0.5, -1.0]), max_size=R))
def test_slowest_is_the_plain_minimum_with_ties_to_the_lowest_id(seconds):
    who, measured, _ = measure(seconds)
    speeds = {r: 1.0 / s for r, s in seconds.items() if s > 0}  # a time that is not positive is no speed
    assert sorted(who.tolist()) == sorted(speeds)
    got = slowest_of(who, measured)
    if not speeds:
        assert got is None
    else:
        low = min(speeds.values())
        assert got == (min(r for r, v in speeds.items() if v == low), low, max(speeds.values()))


def test_an_empty_step_changes_nothing():
    table = SpeedTable(3, 0.2)
    who, measured, slowest = measure({})
    table.update(who, measured)
    assert (table.of(range(3)), slowest, who.dtype) == ({}, 0.0, np.int64)
