"""core.contract.idranges against the plain set-based definitions beside it (hypothesis)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.core.contract import idranges

id_sets = st.sets(st.integers(0, 300), max_size=120)


def plain_ids(ranges) -> set[int]:
    """The plain version: the set of ids a range list names."""
    return {i for a, b in ranges for i in range(a, b)}


def canonical(ranges) -> bool:
    return all(a < b for a, b in ranges) and all(p[1] < q[0] for p, q in zip(ranges, ranges[1:]))


@settings(max_examples=300, deadline=None)
@given(ids=id_sets)
def test_from_ids_is_canonical_and_names_the_same_ids(ids):
    r = idranges.from_ids(ids)
    assert canonical(r) and plain_ids(r) == ids
    assert idranges.to_ids(r) == sorted(ids) and idranges.count(r) == len(ids)
    assert idranges.check(r) is r


def test_from_ids_refuses_duplicates_and_contiguous_ids_are_one_pair():
    with pytest.raises(ValueError):
        idranges.from_ids([3, 4, 3])
    assert idranges.from_ids(range(1000, 1008)) == [[1000, 1008]]
    assert idranges.from_ids([]) == []


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(id_sets, max_size=6), shuffle=st.randoms())
def test_union_disjoint_is_the_union_or_refuses_an_overlap(parts, shuffle):
    lists = [idranges.from_ids(p) for p in parts]
    # pairs may come in any order, and a list need not be canonical (split pieces)
    lists = [[list(x) for x in sub] for sub in lists]
    for sub in lists:
        shuffle.shuffle(sub)
    overlap = sum(len(p) for p in parts) != len(set().union(*parts))
    if overlap:
        with pytest.raises(ValueError):
            idranges.union_disjoint(lists)
    else:
        u = idranges.union_disjoint(lists)
        assert canonical(u) and plain_ids(u) == set().union(*parts)


@settings(max_examples=300, deadline=None)
@given(ids=id_sets, cuts=st.lists(st.integers(0, 120), max_size=8), overlap=st.integers(0, 2))
def test_union_of_pieces_in_order_is_the_whole_and_an_overlap_is_still_refused(ids, cuts, overlap):
    """The in-order pass (a step's ledgers read in replica order): the same answer as
    the plain definition, and an id named twice by neighbouring pieces is refused."""
    r = idranges.from_ids(ids)
    bounds = sorted(min(c, len(ids)) for c in cuts)
    pieces = idranges.split(r, [b - a for a, b in zip([0] + bounds, bounds + [len(ids)])])
    before = [[list(p) for p in piece] for piece in pieces]
    assert idranges.union_disjoint(pieces) == r and idranges.union_disjoint(iter(pieces)) == r
    assert pieces == before  # merging touching pairs never writes into the inputs
    if overlap and r:
        a, b = r[-1]
        pieces.append([[max(a, b - overlap), b]])  # ids the last piece already names
        with pytest.raises(ValueError):
            idranges.union_disjoint(pieces)


pair = st.tuples(st.integers(0, 40), st.integers(1, 12)).map(lambda t: [t[0], t[0] + t[1]])


@settings(max_examples=500, deadline=None)
@given(lists=st.lists(st.lists(pair, max_size=4), max_size=6), start=st.integers(0, 20), length=st.integers(0, 40),
       tile=st.booleans(), shuffle=st.randoms())
def test_partitions_is_the_plain_definition_in_any_order(lists, start, length, tile, shuffle):
    if tile:  # often a real partition, cut anywhere and listed in any order
        inner = range(start + 1, start + length)  # where a piece may end and the next begin
        cuts = sorted(shuffle.sample(inner, min(len(lists), len(inner))))
        pieces = [[[a, b]] for a, b in zip([start] + cuts, cuts + [start + length])] if length else []
        lists = [list(p) for p in pieces]
        shuffle.shuffle(lists)
    named = [i for ranges in lists for a, b in ranges for i in range(a, b)]
    plain = sorted(named) == list(range(start, start + length))
    assert idranges.partitions(lists, start, start + length) == plain
    if tile:
        assert plain and idranges.partitions(iter(lists), start, start + length)


@settings(max_examples=300, deadline=None)
@given(ids=id_sets, offset=st.integers(0, 130), size=st.integers(0, 130))
def test_window_and_position_match_the_sorted_ids(ids, offset, size):
    r = idranges.from_ids(ids)
    flat = sorted(ids)
    if offset + size > len(flat):
        with pytest.raises(ValueError):
            idranges.window(r, offset, size)
    else:
        w = idranges.window(r, offset, size)
        assert canonical(w) and idranges.to_ids(w) == flat[offset:offset + size]
    for k, i in enumerate(flat):
        assert idranges.position(r, i) == k
    for i in set(range(0, 302)) - ids:
        with pytest.raises(ValueError):
            idranges.position(r, i)


@settings(max_examples=300, deadline=None)
@given(ids=id_sets, start=st.integers(0, 300), length=st.integers(0, 300))
def test_is_exactly_and_difference_match_the_set_definitions(ids, start, length):
    stop = start + length
    r = idranges.from_ids(ids)
    assert idranges.is_exactly(r, start, stop) == (ids == set(range(start, stop)))
    d = idranges.difference(start, stop, r)
    assert canonical(d) and plain_ids(d) == set(range(start, stop)) - ids


@settings(max_examples=300, deadline=None)
@given(ids=id_sets, cuts=st.lists(st.integers(0, 120), max_size=8))
def test_split_cuts_in_id_order_into_the_given_sizes(ids, cuts):
    r = idranges.from_ids(ids)
    n = len(ids)
    bounds = sorted(min(c, n) for c in cuts)
    sizes = [b - a for a, b in zip([0] + bounds, bounds + [n])]
    pieces = idranges.split(r, sizes)
    flat = sorted(ids)
    at = 0
    for size, piece in zip(sizes, pieces):
        assert canonical(piece) and idranges.to_ids(piece) == flat[at:at + size]
        at += size
    with pytest.raises(ValueError):
        idranges.split(r, sizes + [1])


@pytest.mark.parametrize("bad", [{"a": 1}, [[3, 3]], [[4, 2]], [[1, 2, 3]], [[1.0, 2]], [[True, 2]], [5]])
def test_check_refuses_what_is_not_a_range_list(bad):
    with pytest.raises(ValueError):
        idranges.check(bad)
