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
- `is_exactly(ranges, start, stop)`: whether a canonical range list is exactly
  [start, stop), O(1).
- `difference(start, stop, ranges)`: the ids of [start, stop) that a canonical range
  list does not name, canonical, O(pairs).
- `split(ranges, sizes)`: cut a canonical range list, in id order, into consecutive
  pieces of the given sizes (summing to `count`), each a canonical range list.
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
    return [i for a, b in ranges for i in range(a, b)]


def count(ranges: Sequence[Sequence[int]]) -> int:
    return sum(b - a for a, b in ranges)


def union_disjoint(lists: Iterable[Sequence[Sequence[int]]]) -> Ranges:
    """The canonical union of range lists; ValueError if two pairs share an id."""
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
