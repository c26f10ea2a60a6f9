"""core/coordinator/fencing.py's pieces on their own: attribution, bans, what a ledger may hold.

The machine-level exclusion (a persistent fault fenced after `fence_after` generations,
corrupt weights fenced before their gradient counts) is in tests/test_protocol_exclusion.py;
here each piece is checked directly on a machine set up by hand:
- `_implicated`: the first reporter, unless a member was lost in the failure or all reported;
- `_attribute_failure` fences at `fence_after` in a row, and another member implicated in
  between starts the count over;
- `_ban` bans the process (its pid) only when one is known; `on_bad` of a replica that is
  not alive only closes it;
- `_within` (ids inside what was allowed) and `_initial_weights_differ` (the minority named).
Pure: no processes.
"""
from __future__ import annotations

from recover.core.coordinator.fencing import FencingMixin
from recover.core.coordinator.protocol import ProtocolStateMachine


def machine(R: int = 3, fence_after: int = 2) -> ProtocolStateMachine:
    proto = ProtocolStateMachine(R, 6, 10, join_timeout=30.0, now=0.0, fence_after=fence_after)
    proto.members, proto.member_set = list(range(R)), set(range(R))
    proto.alive, proto.expected = set(range(R)), set(range(R))
    return proto


def test_the_first_reporter_is_implicated_unless_a_loss_or_everyone_explains_it():
    proto = machine()
    assert proto._implicated() is None  # nobody reported
    proto.reporters = [2, 0]
    assert proto._implicated() == 2
    proto.lost_in_failure = True
    assert proto._implicated() is None
    proto.lost_in_failure, proto.reporters = False, [1, 0, 2]
    assert proto._implicated() is None  # symmetric: the network, not a member


def test_a_member_implicated_fence_after_times_in_a_row_is_fenced():
    proto = machine(fence_after=2)
    proto.pids = {1: 111}
    proto.gen, proto.reporters = 4, [1]
    assert proto._attribute_failure(1.0) == [] and proto.implicated_streak == {1: [4]} and proto.reporters == []
    proto.gen, proto.reporters = 5, [2]  # another member implicated: 1's streak ends
    assert proto._attribute_failure(2.0) == [] and proto.implicated_streak == {2: [5]}
    for gen in (6, 7):
        proto.gen, proto.reporters = gen, [1]
        out = proto._attribute_failure(3.0)
    fenced, close = out
    assert fenced.msg["kind"] == "fenced" and fenced.msg["replica"] == 1 and fenced.msg["generations"] == [6, 7]
    assert close.kind == "close" and close.replica == 1
    assert 1 in proto.dead and 1 not in proto.alive | proto.expected and proto.banned == {1: 111}
    assert proto.implicated_streak == {} and proto.pending[-1]["fault"].startswith("replica 1 fenced")


def test_a_ban_needs_a_pid_and_a_dead_replica_is_only_closed():
    proto = machine()
    proto._ban(0)  # no hello, no pid: nothing to ban
    assert proto.banned == {}
    proto.alive.discard(2)
    (close,) = proto.on_bad(2, "a stale line", 1.0)
    assert close.kind == "close" and close.reason == "replica 2 fenced: a stale line" and proto.banned == {}


def test_within_and_initial_weights():
    within = FencingMixin._within
    assert within([[2, 4]], [[0, 3], [3, 6]]) and within([], [[0, 1]]) and within([[9, 10]], None)
    assert not within([[2, 7]], [[0, 6]]) and not within([[0, 1], [6, 7]], [[0, 6]])
    proto = machine(R=4)
    proto.joins = {0: [], 1: [], 2: [], 3: []}
    proto.digests = {0: "a" * 64, 1: "a" * 64, 2: "b" * 64}  # replica 3 sent none
    assert "replica(s) [2] do not match replica(s) [0, 1]" in proto._initial_weights_differ()
    proto.digests[2] = "a" * 64
    assert proto._initial_weights_differ() == ""
