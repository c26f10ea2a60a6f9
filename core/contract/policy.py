"""Quota policy (layer 3): which replica does which microbatch ids.

Contract: `assign_quotas(ids, replicas, speeds)` is a pure function (and so is
`assign_quota_ranges`, the same on ids written as core.contract.idranges range lists).
- The quotas always partition `ids`: every id in exactly one quota, nothing added.
- With equal (or absent) speeds, quota sizes differ by at most 1.
- With unequal speeds (microbatches per second), the sizes minimise the makespan
  max_r(size_r / speed_r); among optimal answers the one chosen is deterministic.
- Quotas are contiguous runs of the sorted ids, handed out in sorted replica order,
  so every process that evaluates the policy on the same inputs gets the same answer.
- `equal_share(ids, members, r)`: replica r's quota of `assign_quota_ranges(ids,
  members)` with equal speeds, computed alone in O(pairs) (closed form). This is
  what lets the coordinator send one message to every member (the ids and the
  members) instead of R messages that differ in their quota: each worker takes
  its own share (`quota_of`, on a gen or commit message).
"""
from __future__ import annotations

import heapq
from typing import Mapping, Sequence

from recover.core.contract import idranges


def quota_sizes(n: int, replicas: Sequence[int], speeds: Mapping[int, float] | None = None) -> dict[int, int]:
    """How many ids each replica gets: the makespan-optimal integer split of `n`.

    Greedy: give the next id to the replica that would finish it first. For
    identical jobs on machines of different speeds this is optimal (each
    assignment keeps the running makespan as small as it can be), and with equal
    speeds it deals ids round-robin, so sizes differ by at most 1.
    """
    reps = sorted(replicas)
    if not reps:
        raise ValueError("no live replicas to assign microbatches to")
    if speeds is None:
        speeds = {}
    rate = {r: float(speeds.get(r, 1.0)) for r in reps}
    for r, s in rate.items():
        if not s > 0:
            raise ValueError(f"replica {r} has non-positive speed {s}")
    if len(set(rate.values())) == 1:
        # Equal speeds: the greedy below deals round-robin in replica order, so its
        # answer is this closed form (O(R) instead of O(n log R); `greedy_quota_sizes`
        # is the plain version the tests compare it with).
        base, extra = divmod(n, len(reps))
        return {r: base + (1 if i < extra else 0) for i, r in enumerate(reps)}
    return greedy_quota_sizes(n, reps, rate)


def greedy_quota_sizes(n: int, replicas: Sequence[int], rate: Mapping[int, float]) -> dict[int, int]:
    """The greedy split of `quota_sizes` itself, one id at a time (O(n log R))."""
    reps = sorted(replicas)
    counts = {r: 0 for r in reps}
    # Heap of (finish time if given one more id, replica order index).
    heap = [(1.0 / rate[r], i) for i, r in enumerate(reps)]
    heapq.heapify(heap)
    for _ in range(n):
        _, i = heapq.heappop(heap)
        r = reps[i]
        counts[r] += 1
        heapq.heappush(heap, ((counts[r] + 1) / rate[r], i))
    return counts


def assign_quotas(
    ids: Sequence[int], replicas: Sequence[int], speeds: Mapping[int, float] | None = None
) -> dict[int, list[int]]:
    """Partition `ids` over `replicas` by `quota_sizes`, as contiguous sorted runs."""
    sizes = quota_sizes(len(ids), replicas, speeds)
    todo = sorted(ids)
    out: dict[int, list[int]] = {}
    start = 0
    for r in sorted(replicas):
        out[r] = todo[start : start + sizes[r]]
        start += sizes[r]
    return out


def assign_quota_ranges(
    ids: Sequence[Sequence[int]], replicas: Sequence[int], speeds: Mapping[int, float] | None = None
) -> dict[int, list[list[int]]]:
    """`assign_quotas` on ids written as a canonical range list (core.contract.idranges), answered
    as range lists: the same partition, in O(R + pairs) whatever the number of ids."""
    reps = sorted(replicas)
    sizes = quota_sizes(idranges.count(ids), reps, speeds)
    return dict(zip(reps, idranges.split(ids, [sizes[r] for r in reps])))


def makespan(sizes: Mapping[int, int], speeds: Mapping[int, float] | None = None) -> float:
    """The iteration's duration under the model 'replica r does size_r ids at speed_r'."""
    speeds = speeds or {}
    return max((n / float(speeds.get(r, 1.0)) for r, n in sizes.items()), default=0.0)


def equal_share(ids: Sequence[Sequence[int]], members: Sequence[Sequence[int]], r: int) -> list[list[int]]:
    """Replica r's quota when the canonical range list `ids` is dealt over `members` (a
    canonical range list of replica ids) at equal speeds: `assign_quota_ranges(ids,
    idranges.to_ids(members))[r]`, without computing anyone else's (O(pairs))."""
    n_members = idranges.count(members)
    if not n_members:
        raise ValueError("no live replicas to assign microbatches to")
    i = idranges.position(members, r)  # r's place in replica order (ValueError if not a member)
    # quota_sizes' closed form: the first `extra` replicas get one id more
    base, extra = divmod(idranges.count(ids), n_members)
    return idranges.window(ids, i * base + min(i, extra), base + (1 if i < extra else 0))


def quota_of(msg: Mapping, members: Sequence[Sequence[int]], r: int) -> list[list[int]]:
    """The quota a gen or commit message gives replica r, a member of `members` (range list).

    A message with `quota` names r's own ids (speeds differ: the coordinator sent each
    member its own); one with `split` names the ids every member shares at equal speeds
    (one message for all), of which r takes its `equal_share`."""
    if "quota" in msg:
        return msg["quota"]
    return equal_share(msg["split"], members, r)


def quota_in(quota: list[list[int]] | None, split: list[list[int]] | None, members: Sequence[Sequence[int]],
             r: int) -> list[list[int]]:
    """`quota_of` for a typed message (core/contract/step_messages.py `Commit`): its `quota` when it
    names one (None: not sent), else r's `equal_share` of `split`."""
    if quota is not None:
        return quota
    return equal_share(split, members, r)
