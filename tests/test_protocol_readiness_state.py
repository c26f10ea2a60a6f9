"""core/coordinator/readiness.py's `Readiness` on its own: the ready/go round and the progress rule's arithmetic.

The machine-level behaviour (go once all are ready, the last vote's deadline, a stuck
member lost) is in tests/test_protocol_readiness.py and tests/test_protocol_progress.py;
here the state object is driven directly:
- `go` is due exactly when the last member is ready, and a new round forgets the last one's;
- a vote's `progress_gap` only loosens the bound, and anything not a finite number >= 0 is ignored;
- the stall bound is the collective timeout plus four gaps plus two heartbeat intervals;
- a member's silence counts from its last progress, never from before it owed work;
- the machine's read-only names (`ready`, `go_at`, `vote_deadline`, `owed_since`) show this state.
Pure: no processes.
"""
from __future__ import annotations

from recover.core.coordinator import protocol
from recover.core.coordinator.protocol import ProtocolStateMachine
from recover.core.coordinator.readiness import STALL_SCAN_SECONDS, Readiness


def test_go_is_due_when_the_last_member_is_ready_and_a_new_round_forgets_it():
    rd = Readiness(owed_since=0.0, next_stall_scan=0.0)
    assert not rd.mark_ready(2, 3, 1.0) and not rd.mark_ready(0, 3, 1.5) and rd.go_at is None
    assert not rd.mark_ready(2, 3, 1.7)  # a repeat counts once
    assert rd.mark_ready(1, 3, 2.0) and rd.go_at == 2.0 and rd.ready == {0, 1, 2}
    rd.bound_last_vote(5.0, join_timeout=10.0)
    assert rd.vote_deadline == 5.0 + 10.0 + 4 * (5.0 - 2.0)
    rd.progress_at[1] = 4.0
    rd.new_round(6.0)
    assert (rd.ready, rd.go_at, rd.vote_deadline, rd.owed_since) == (set(), None, None, 6.0)
    assert rd.progress_at == {1: 4.0}  # progress is per replica, not per round
    rd.bound_last_vote(7.0, join_timeout=10.0)  # no go yet (a one-member generation): nothing took
    assert rd.vote_deadline == 17.0


def test_a_gap_only_loosens_the_bound_and_junk_is_ignored():
    rd = Readiness(owed_since=0.0, next_stall_scan=0.0)
    assert rd.stall_bound(0, 30.0, 1.0) is None  # not measured yet
    for junk in (None, -1.0, float("inf"), float("nan"), "2", True):
        rd.note_gap(0, junk)
    assert rd.progress_gap == {} and rd.longest_gap is None
    rd.note_gap(0, 2.0)
    rd.note_gap(0, 0.5)  # smaller: the bound stays
    rd.note_gap(1, 1)
    assert rd.progress_gap == {0: 2.0, 1: 1} and rd.longest_gap == 2.0
    assert rd.stall_bound(0, 30.0, 1.0) == 30.0 + 4 * 2.0 + 2 * 1.0
    assert rd.stall_bound(1, 30.0, None) == 30.0 + 4 * 1


def test_silence_counts_from_the_last_progress_or_from_when_work_was_owed():
    rd = Readiness(owed_since=10.0, next_stall_scan=0.0)
    assert rd.silent_since(0) == 10.0  # no progress seen yet
    rd.progress_at[0] = 4.0  # progress before it owed this work does not count
    assert rd.silent_since(0) == 10.0
    rd.progress_at[0] = 12.0
    assert rd.silent_since(0) == 12.0


def test_the_machine_shows_the_state_under_its_old_names():
    assert protocol.STALL_SCAN_SECONDS == STALL_SCAN_SECONDS
    proto = ProtocolStateMachine(2, 4, 3, join_timeout=30.0, now=5.0)
    assert proto.owed_since == 5.0 and proto.ready == set() and proto.go_at is None and proto.vote_deadline is None
    proto.readiness.mark_ready(1, 2, 6.0)
    assert proto.ready is proto.readiness.ready and proto.ready == {1}
    proto.on_progress(1, 7.0)
    assert proto.readiness.progress_at == {1: 7.0} and proto.stall_bound(1) is None
