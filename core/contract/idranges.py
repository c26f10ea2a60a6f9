"""Sets of integer ids written as ranges: how quotas, ledgers and members travel.

A range list is a JSON-ready list of half-open pairs `[[start, stop], ...]`, each
pair holding the ids start, start+1, ..., stop-1 (start < stop, ints). Contiguous
ids are the common case (a quota is a contiguous run of its step's ids; a ledger
is the quota folded; members are replicas 0..R-1 minus the dead), so a message
carries a few numbers however many ids it names.

Contract (every function is pure; `tests/test_idranges.py` checks each against the
plain set-based definition beside it):
- `from_ids(ids)`: the canonical range list of distinct ids (sorted, maximal runs:
  no two pairs touch or overlap); duplicates are refused (ValueError).
- `to_ids(ranges)`: the ids, in the order the pairs list them.
- `count(ranges)`: how many ids (pairs are taken to be disjoint), O(pairs).
- `union_disjoint(lists)`: the canonical range list of the union of several range
  lists, or ValueError if any id is named twice (within a list or across lists).
  O(p log p) for p pairs, O(p) when the pairs already come in order, as quotas
  handed out in replica order do.
- `partitions(lists, start, stop)`: whether range lists (in any order, canonical or
  not) together name each id of [start, stop) exactly once: O(pairs), no sort, so
  a step's ledgers can be checked in the order their votes arrived.
- `is_exactly(ranges, start, stop)`: whether a canonical range list is exactly
  [start, stop), O(1).
- `difference(start, stop, ranges)`: the ids of [start, stop) that a canonical range
  list does not name, canonical, O(pairs).
- `split(ranges, sizes)`: cut a canonical range list, in id order, into consecutive
  pieces of the given sizes (summing to `count`), each a canonical range list.
- `window(ranges, offset, size)`: the `size` ids that follow the first `offset` ids
  of a canonical range list, in id order, canonical; O(pairs) (one piece of a
  `split`, without cutting the others).
- `position(ranges, i)`: how many ids of a canonical range list come before id `i`,
  which it must name (ValueError otherwise), O(pairs).
- `check(obj)`: `obj` as a list of (start, stop) int pairs, or ValueError naming
  what is wrong: what arrives on the wire is checked before it is used.
"""
from __future__ import annotations

from typing import Iterable, Sequence

Ranges = list[list[int]]


def check(obj) -> Ranges:
    """`obj` if it is a list of [start, stop] int pairs with start < stop, else ValueError."""
    if not isinstance(obj, list):
        raise ValueError(f"id ranges must be a list of [start, stop] pairs, got {type(obj).__name__}")
    for p in obj:
        if (not isinstance(p, (list, tuple)) or len(p) != 2 or type(p[0]) is not int or type(p[1]) is not int
                or not p[0] < p[1]):
            raise ValueError(f"bad id range {p!r}: want [start, stop] ints with start < stop")
    return obj


def from_ids(ids: Iterable[int]) -> Ranges:
    """The canonical range list of distinct ids (ValueError on a duplicate)."""
    out: Ranges = []
    for i in sorted(ids):
        if out and i < out[-1][1]:
            raise ValueError(f"id {i} named twice")
        if out and i == out[-1][1]:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def to_ids(ranges: Sequence[Sequence[int]]) -> list[int]:
    """The ids the pairs name, in the order listed."""
    if len(ranges) == 1:  # the common case (a step's M ids, all members): list(range) is C speed
        return list(range(ranges[0][0], ranges[0][1]))
    return [i for a, b in ranges for i in range(a, b)]


def count(ranges: Sequence[Sequence[int]]) -> int:
    return sum(b - a for a, b in ranges)


def union_disjoint(lists: Iterable[Sequence[Sequence[int]]]) -> Ranges:
    """The canonical union of range lists; ValueError if two pairs share an id."""
    lists = lists if isinstance(lists, list) else list(lists)
    # The common case first: the pairs come in id order (a step's votes read in
    # replica order, each ledger one quota), so one pass merges them with no sort.
    out: Ranges = []
    end = None
    for ranges in lists:
        for a, b in ranges:
            if end is not None and a <= end:
                if a < end:  # out of order, or an id named twice: the general way below tells which
                    return _union_sorted(lists)
                out[-1][1] = b
            else:
                out.append([a, b])
            end = b
    return out


def _union_sorted(lists: list[Sequence[Sequence[int]]]) -> Ranges:
    """`union_disjoint` for pairs in any order (the plain version: sort, then merge)."""
    pairs = sorted((a, b) for ranges in lists for a, b in ranges)
    out: Ranges = []
    for a, b in pairs:
        if out and a < out[-1][1]:
            raise ValueError(f"ids [{a}, {min(b, out[-1][1])}) named twice")
        if out and a == out[-1][1]:
            out[-1][1] = b
        else:
            out.append([a, b])
    return out


def partitions(lists: Iterable[Sequence[Sequence[int]]], start: int, stop: int) -> bool:
    """Whether the pairs of `lists` tile [start, stop): each id of it named exactly once, no other."""
    # Chain the pairs by their starts: from `start`, each hop takes the pair beginning
    # where the last one ended. Reaching `stop` after using every pair means the pairs
    # are contiguous and disjoint; two pairs with one start (an overlap) collapse to
    # one key and leave a pair unused, as does any pair off the chain.
    ends: dict[int, int] = {}
    n = 0
    for ranges in lists:
        for a, b in ranges:
            ends[a] = b
            n += 1
    if len(ends) != n:
        return False
    at = start
    for _ in range(n):
        nxt = ends.get(at)
        if nxt is None or nxt <= at:
            return False
        at = nxt
    return at == stop


def is_exactly(ranges: Sequence[Sequence[int]], start: int, stop: int) -> bool:
    """Whether canonical `ranges` are exactly [start, stop) (the empty list when start == stop)."""
    if start >= stop:
        return not ranges
    return len(ranges) == 1 and ranges[0][0] == start and ranges[0][1] == stop


def difference(start: int, stop: int, ranges: Sequence[Sequence[int]]) -> Ranges:
    """The ids of [start, stop) not in canonical `ranges`, as a canonical range list."""
    out: Ranges = []
    at = start
    for a, b in ranges:
        a, b = max(a, start), min(b, stop)
        if a >= b:
            continue
        if at < a:
            out.append([at, a])
        at = max(at, b)
    if at < stop:
        out.append([at, stop])
    return out


def split(ranges: Sequence[Sequence[int]], sizes: Sequence[int]) -> list[Ranges]:
    """Consecutive pieces of `ranges` (in id order) of the given sizes, each canonical."""
    if sum(sizes) != count(ranges):
        raise ValueError(f"sizes add up to {sum(sizes)}, the ranges hold {count(ranges)} ids")
    pieces: list[Ranges] = []
    k, at = 0, ranges[0][0] if ranges else 0  # next pair, next id in it
    for n in sizes:
        piece: Ranges = []
        while n > 0:
            stop = ranges[k][1]
            take = min(n, stop - at)
            piece.append([at, at + take])
            n -= take
            at += take
            if at == stop:
                k += 1
                at = ranges[k][0] if k < len(ranges) else at
        pieces.append(piece)
    return pieces


def window(ranges: Sequence[Sequence[int]], offset: int, size: int) -> Ranges:
    """The ids numbered offset .. offset+size-1 of canonical `ranges` (in id order), canonical."""
    if offset < 0 or size < 0 or offset + size > count(ranges):
        raise ValueError(f"ids {offset}..{offset + size} are not within the {count(ranges)} ids of the ranges")
    out: Ranges = []
    for a, b in ranges:
        if size == 0:
            break
        if offset >= b - a:
            offset -= b - a
            continue
        start = a + offset
        stop = min(b, start + size)
        out.append([start, stop])
        size -= stop - start
        offset = 0
    return out


def position(ranges: Sequence[Sequence[int]], i: int) -> int:
    """How many ids of canonical `ranges` precede id `i` (ValueError if `i` is not one of them)."""
    before = 0
    for a, b in ranges:
        if a <= i < b:
            return before + i - a
        before += b - a
    raise ValueError(f"id {i} is not in the ranges")
