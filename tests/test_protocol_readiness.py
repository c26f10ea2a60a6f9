"""Readiness and the vote deadline in the state machine: slow is not dead.

A member that takes long to fold its quota is never removed for it: the
all-reduce starts on `go`, once every member said `ready`; the only deadline
after `go` is on the last vote, once every other member has voted. Pure: the
real `ProtocolStateMachine`, driven with explicit times.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from recover.core.contract import idranges
from recover.core.coordinator.protocol import ProtocolStateMachine
from recover.core.contract.step_messages import Ready, Vote

from conftest import as_read

TIMEOUT = 1.0  # the collective timeout (the state machine's join_timeout)


def formed(R: int, M: int, steps: int = 3) -> tuple[ProtocolStateMachine, dict[int, list]]:
    proto = ProtocolStateMachine(R, M, steps, join_timeout=TIMEOUT, now=0.0)
    quotas = {}
    for r in range(R):
        quotas.update({a.replica: as_read(a.msg, a.replica)["quota"] for a in proto.on_hello(r, {"tokens_per_mb": 1}, 0.0)
                       if a.kind == "send" and a.msg["t"] == "gen"})
    assert proto.state == "running" and proto.members == list(range(R))
    return proto, quotas


def ready(proto: ProtocolStateMachine, r: int, now: float) -> list:
    return proto.on_ready(r, Ready.from_wire({"t": "ready", "gen": proto.gen, "step": proto.step}), now)


def vote(proto: ProtocolStateMachine, r: int, ledger, now: float) -> list:
    return proto.on_vote(r, Vote.from_wire({"t": "vote", "gen": proto.gen, "step": proto.step, "ok": True,
                                            "ledger": ledger,
                                            "loss_sum": 1.0, "mb_seconds": 0.1, "lr": 0.001}), now)


def test_go_goes_to_every_member_once_all_are_ready_and_not_before():
    proto, _ = formed(3, 6)
    assert ready(proto, 0, 1.0) == [] and ready(proto, 2, 50.0) == []
    assert ready(proto, 0, 51.0) == []  # a repeat changes nothing
    outs = ready(proto, 1, 400.0)  # the slowest member, 400 collective timeouts later
    assert [(o.kind, o.replica, o.msg) for o in outs] == [
        ("send", r, {"t": "go", "gen": 0, "step": 0}) for r in range(3)]
    assert outs[0].msg is outs[2].msg  # one message object for all: the service encodes it once
    assert ready(proto, 1, 401.0) == []  # after go, a repeat is ignored


def test_ready_of_another_generation_or_of_a_non_member_is_ignored():
    proto, _ = formed(2, 4)
    assert proto.on_ready(0, Ready.from_wire({"gen": 7, "step": 0}), 0.0) == []
    assert proto.on_ready(5, Ready.from_wire({"gen": 0, "step": 0}), 0.0) == []
    assert proto.ready == set()


def test_a_member_slow_to_fold_is_never_removed_by_the_clock():
    proto, quotas = formed(3, 6)
    ready(proto, 0, 0.5)
    ready(proto, 1, 0.6)
    for t in (1.0, 10.0, 1e3, 1e6):  # replica 2 folds for a very long time; ticks pass
        assert proto.on_tick(t) == []
    assert proto.members == [0, 1, 2] and proto.state == "running"
    ready(proto, 2, 1e6 + 1)
    outs = [o for r in range(3) for o in vote(proto, r, quotas[r], 1e6 + 2)]
    assert any(o.kind == "commit" for o in outs) and proto.step == 1


def test_the_last_vote_is_due_within_the_timeout_plus_four_times_what_the_others_took():
    proto, quotas = formed(3, 6)
    for r in range(3):
        ready(proto, r, 10.0)  # go at t = 10
    vote(proto, 0, quotas[0], 10.2)
    vote(proto, 1, quotas[1], 10.5)  # the others took 0.5 s from go: the last is due at 10.5 + 1 + 2
    assert proto.vote_deadline == 10.5 + TIMEOUT + 4 * 0.5
    assert proto.on_tick(13.4) == []
    outs = proto.on_tick(13.6)
    closed = [o for o in outs if o.kind == "close"]
    assert [o.replica for o in closed] == [2] and "did not vote for step 0" in closed[0].reason
    aborts = [o for o in outs if o.kind == "send" and o.msg["t"] == "abort"]
    assert sorted(o.replica for o in aborts) == [0, 1]  # the survivors keep their ledgers and redo its share
    assert proto.state == "forming" and 2 in proto.dead


def test_a_vote_deadline_is_forgotten_with_its_step():
    proto, quotas = formed(2, 4)
    for r in range(2):
        ready(proto, r, 0.0)
    vote(proto, 0, quotas[0], 0.1)
    assert proto.vote_deadline is not None
    vote(proto, 1, quotas[1], 0.2)  # commits
    assert proto.step == 1 and proto.vote_deadline is None and proto.go_at is None and proto.ready == set()
    assert proto.on_tick(1e9) == []


@settings(max_examples=200, deadline=None)
@given(R=st.integers(1, 5), steps=st.integers(1, 4), data=st.data())
def test_members_that_keep_beating_are_never_removed_whatever_the_timing(R, steps, data):
    """Ready, vote and tick times drawn at random (quotas from 0 to 100 collective timeouts,
    votes within the timeout of go, ticks anywhere): every step commits with every member."""
    M = R + 2
    proto, quotas = formed(R, M, steps)
    now = 0.0
    for step in range(steps):
        fold = {r: data.draw(st.floats(0, 100 * TIMEOUT)) for r in range(R)}
        lag = {r: data.draw(st.floats(0, 0.99 * TIMEOUT)) for r in range(R)}
        events = [(now + fold[r], "ready", r) for r in range(R)]
        go = now + max(fold.values())
        events += [(go + lag[r], "vote", r) for r in range(R)]
        events += [(now + t, "tick", -1) for t in data.draw(st.lists(st.floats(0, 200 * TIMEOUT), max_size=8))]
        events.sort(key=lambda e: (e[0], e[1] == "vote"))  # a vote never overtakes its go
        outs = []
        for t, kind, r in events:
            if kind == "ready":
                outs += ready(proto, r, t)
            elif kind == "vote":
                outs += vote(proto, r, quotas[r], t)
            else:
                outs += proto.on_tick(t)
        assert not [o for o in outs if o.kind == "close"], outs
        assert proto.step == step + 1 and proto.members == list(range(R))
        now = max(e[0] for e in events)
        if step + 1 < steps:  # the next step's quotas come with the commit
            quotas = {o.replica: as_read(o.msg, o.replica, idranges.from_ids(proto.members))["quota"]
                      for o in outs if o.kind == "send" and o.msg["t"] == "commit"}
    assert proto.state == "finished"
