"""The progress rule in the state machine: slow is not dead, stuck is.

A member owes work while its step runs and it has not said `ready`, and while a generation
forms and it has not rejoined. Owing, with no progress (`on_progress`: its heartbeat's count
moved, or it sent a message) for longer than the collective timeout plus four times the
longest gap it measured itself (its votes' `progress_gap`) plus two heartbeat intervals, it is
lost. Pure: the real `ProtocolStateMachine`, driven with explicit times; hypothesis draws the
arrival times of progress, ready and heartbeats for members of any speed.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from recover.core.coordinator.protocol import STALL_SCAN_SECONDS, ProtocolStateMachine
from recover.core.contract.step_messages import Ready, Vote

from conftest import as_read

TIMEOUT = 1.0  # the collective timeout (the state machine's join_timeout)
BEAT = 0.1  # heartbeat interval: progress reaches the coordinator with the next beat
EPS = 1e-9  # float rounding of times, far below any tick


def measured(R: int, gaps: dict[int, float], M: int | None = None) -> ProtocolStateMachine:
    """R members past step 0, whose votes reported `gaps`; step 1 runs, every member owes its work."""
    M = M or 2 * R
    proto = ProtocolStateMachine(R, M, 10, join_timeout=TIMEOUT, now=0.0, heartbeat_interval=BEAT)
    quotas = {}
    for r in range(R):
        quotas.update({a.replica: as_read(a.msg, a.replica)["quota"] for a in proto.on_hello(r, {"tokens_per_mb": 1}, 0.0)
                       if a.kind == "send" and a.msg["t"] == "gen"})
    for r in range(R):
        proto.on_ready(r, Ready.from_wire({"t": "ready", "gen": 0, "step": 0}), 0.5)
    outs = []
    for r in range(R):
        outs += proto.on_vote(r, Vote.from_wire({"t": "vote", "gen": 0, "step": 0, "ok": True,
                                                 "ledger": quotas[r], "loss_sum": 1.0,
                                                 "progress_gap": gaps[r]}), 1.0)
    assert any(o.kind == "commit" for o in outs) and proto.step == 1 and proto.owed_since == 1.0
    return proto


def closed(outs) -> list[int]:
    return [o.replica for o in outs if o.kind == "close"]


def test_a_member_that_stops_progressing_is_lost_at_its_bound_and_not_before():
    proto = measured(3, {0: 0.1, 1: 0.5, 2: 0.1})
    assert proto.stall_bound(1) == TIMEOUT + 4 * 0.5 + 2 * BEAT
    t_lost = 1.0 + proto.stall_bound(1)
    t = 1.0
    while t < t_lost - 0.01:  # 0 and 2 progress every 0.05 s, 1 never does after the commit at t = 1
        t += 0.05
        proto.on_progress(0, t)
        proto.on_progress(2, t)
        assert closed(proto.on_tick(min(t, t_lost - 0.01))) == []
    proto.on_progress(0, t_lost)
    proto.on_progress(2, t_lost)
    outs = proto.on_tick(t_lost + STALL_SCAN_SECONDS + 0.01)
    assert closed(outs) == [1]
    assert "no progress for" in [o for o in outs if o.kind == "close"][0].reason
    assert proto.state == "forming" and proto.expected == {0, 2}


def test_a_member_waiting_for_go_owes_nothing_however_long_the_others_take():
    proto = measured(2, {0: 0.05, 1: 0.05})
    # 0 is done, then silent (it waits for go)
    proto.on_ready(0, Ready.from_wire({"t": "ready", "gen": 0, "step": 1}), 1.1)
    for t in range(2, 200):  # 1 takes minutes, progressing every half second
        proto.on_progress(1, float(t) / 2)
        assert closed(proto.on_tick(float(t) / 2)) == []
    assert proto.members == [0, 1]


def test_before_its_first_vote_a_member_is_not_judged_by_progress():
    proto = ProtocolStateMachine(2, 4, 10, join_timeout=TIMEOUT, now=0.0, heartbeat_interval=BEAT)
    for r in range(2):
        proto.on_hello(r, {"tokens_per_mb": 1}, 0.0)
    assert proto.stall_bound(0) is None
    assert closed(proto.on_tick(1e4)) == []  # step 0's one-time costs: the start-up rules judge it


def test_a_forming_generation_waits_for_a_measured_member_that_progresses():
    proto = measured(3, {0: 0.2, 1: 0.2, 2: 0.2})
    outs = proto.on_lost(2, "control connection closed (process gone)", 1.1)
    assert proto.state == "forming" and closed(outs) == [2]
    proto.on_join(0, {"t": "join", "gen": 1, "step": 1, "ledger": []}, 1.2)
    for k in range(1, 200):  # replica 1 finishes a long schedule first: 40 s, a tick every 0.2 s
        t = 1.1 + 0.2 * k
        proto.on_progress(1, t)
        assert closed(proto.on_tick(t)) == [], t
    proto.on_join(1, {"t": "join", "gen": 1, "step": 1, "ledger": []}, 41.2)
    assert proto.state == "running" and proto.members == [0, 1]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), R=st.integers(1, 5))
def test_members_that_keep_progressing_stay_and_one_that_stops_is_lost_within_its_bound(data, R):
    gaps = {r: data.draw(st.floats(0.01, 2.0), label=f"gap{r}") for r in range(R)}
    proto = measured(R, gaps)
    stalled = data.draw(st.one_of(st.none(), st.integers(0, R - 1)), label="stalled")
    events: list[tuple[float, int, str]] = []  # (time, replica, "progress" | "ready")
    stop_at = None
    for r in range(R):
        t, end = 1.0, 1.0 + data.draw(st.floats(0.0, 60.0), label=f"work{r}")
        if r == stalled:
            stop_at = 1.0 + data.draw(st.floats(0.0, 30.0), label="stall_at")
        while True:
            # a unit of work takes at most the member's measured gap; its count rides on the next beat
            t += data.draw(st.floats(0.001, gaps[r]), label="unit")
            if r == stalled and t > stop_at:
                break
            if t >= end:
                events.append((t + data.draw(st.floats(0.0, BEAT)), r, "ready"))
                break
            events.append((t + data.draw(st.floats(0.0, BEAT)), r, "progress"))
    events.sort()
    lost_at: dict[int, float] = {}
    now = 1.0
    for t, r, what in events:
        while now + 0.05 < t:  # the service ticks the machine every 50 ms
            now += 0.05
            lost_at.update({x: now for x in closed(proto.on_tick(now))})
        now = t
        if proto.state != "running" or r not in proto.member_set:
            break  # the stalled member is out: the generation re-forms (the rule of forming is tested above)
        if what == "progress":
            proto.on_progress(r, t)
        else:
            proto.on_ready(r, Ready.from_wire({"t": "ready", "gen": proto.gen, "step": proto.step}), t)
        lost_at.update({x: t for x in closed(proto.on_tick(t))})
    if stalled is not None and stalled not in lost_at and proto.state == "running":
        last = max([t for t, r, _ in events if r == stalled] + [1.0])
        for k in range(1, 2000):  # the others are ready and wait; time passes until the rule fires
            lost_at.update({x: now + 0.05 * k for x in closed(proto.on_tick(now + 0.05 * k))})
            if stalled in lost_at:
                break
    assert set(lost_at) <= ({stalled} if stalled is not None else set()), (lost_at, gaps)
    if stalled is not None and R > 0 and proto.go_at is None:
        assert stalled in lost_at, (gaps, stalled)
        last = max([t for t, r, _ in events if r == stalled and t <= lost_at[stalled]] + [1.0])
        bound = proto.stall_bound(stalled)
        # EPS: the machine sees `now - last > bound` where the sum `last + bound`, rounded, can equal `now`
        assert last + bound - EPS < lost_at[stalled] <= last + bound + STALL_SCAN_SECONDS + 0.1, (last, bound, lost_at)


def test_a_wait_for_newcomers_is_owed_by_nobody_and_the_admitted_step_is_owed_from_admission():
    # min_replicas 2: after replica 1 is lost, step 2 waits for a replacement, which takes 100 s
    # to start (a loaded node). The member waits on the coordinator meanwhile: it owes nothing,
    # and the step it then runs is owed from the admission, not from the commit before the wait.
    proto = ProtocolStateMachine(2, 4, 10, join_timeout=TIMEOUT, now=0.0, heartbeat_interval=BEAT, min_replicas=2,
                                 startup_timeout=1e4)
    quotas = {a.replica: as_read(a.msg, a.replica)["quota"]
              for r in range(2) for a in proto.on_hello(r, {"tokens_per_mb": 1, "can_heal": True, "pid": 10 + r}, 0.0)
              if a.kind == "send" and a.msg["t"] == "gen"}
    for r in range(2):
        proto.on_ready(r, Ready.from_wire({"t": "ready", "gen": 0, "step": 0}), 0.5)
    for r in range(2):
        proto.on_vote(r, Vote.from_wire({"t": "vote", "gen": 0, "step": 0, "ok": True,
                                         "ledger": quotas[r], "loss_sum": 1.0,
                                         "progress_gap": 0.1}), 1.0)
    assert proto.step == 1
    proto.on_lost(1, "control connection closed (process gone)", 1.1)
    proto.on_join(0, {"t": "join", "gen": 1, "step": 1, "ledger": []}, 1.2)
    proto.on_ready(0, Ready.from_wire({"t": "ready", "gen": 1, "step": 1}), 1.3)
    proto.on_vote(0, Vote.from_wire({"t": "vote", "gen": 1, "step": 1, "ok": True, "ledger": [[4, 8]], "loss_sum": 1.0,
                                     "progress_gap": 0.1}), 1.4)
    assert proto.step == 2 and proto.state == "waiting"
    for k in range(1, 400):  # 100 s of waiting, the member silent but for its beats
        assert closed(proto.on_tick(1.4 + 0.25 * k)) == []
    proto.on_hello(1, {"tokens_per_mb": 1, "can_heal": True, "pid": 99}, 101.5)
    assert proto.state == "running" and proto.members == [0, 1]
    assert closed(proto.on_tick(101.5 + STALL_SCAN_SECONDS + 0.01)) == []  # owed from 101.5, not from 1.4
    assert proto.members == [0, 1]
