"""core/coordinator/admission.py's pieces on their own, on a machine set up by hand.

The end-to-end admission (a newcomer admitted at the next commit, healed by a donor,
refused after failed transfers) is in tests/test_protocol_admission.py; here:
- what the service asks: a dead slot takes only a process that can be healed, and a
  reconnect is the process that last said hello;
- a banned process is refused at once, anyone else waits ("pending") with a join record;
- `_short` counts the members and the newcomers against `min_replicas`;
- `_admit` makes the newcomers members of generation gen+1 with the fastest member as
  donor (ties: the lowest id) and holds them unhealed until their state arrives.
Pure: no processes.
"""
from __future__ import annotations

from recover.core.coordinator.protocol import ProtocolStateMachine


def machine(R: int = 4, **kw) -> ProtocolStateMachine:
    proto = ProtocolStateMachine(R, 8, 10, join_timeout=30.0, now=0.0, **kw)
    proto.state, proto.gen, proto.next_gen, proto.step = "running", 2, 2, 3
    proto.members, proto.member_set, proto.alive, proto.dead = [0, 1], {0, 1}, {0, 1}, {2, 3}
    return proto


def test_what_the_service_asks():
    proto = machine()
    assert proto.slot_open_to(0, can_heal=False) and proto.slot_open_to(2, can_heal=True)
    assert not proto.slot_open_to(2, can_heal=False)
    proto.note_pid(0, 4242)
    assert proto.same_process(0, 4242) and not proto.same_process(0, 1) and not proto.same_process(1, None)


def test_a_banned_process_is_refused_and_anyone_else_waits():
    proto = machine()
    proto.banned[2] = 77
    (refused,) = proto._newcomer(2, {"pid": 77, "can_heal": True}, 1.0)
    assert refused.kind == "close" and refused.msg == {"t": "refused"} and 2 in proto.dead and not proto.newcomers
    (pending,) = proto._newcomer(3, {"pid": 88, "can_heal": True, "rejoin": True, "started_at": 0.5}, 1.0)
    assert pending.kind == "send" and pending.msg == {"t": "pending", "step": 3} and 3 in proto.alive
    assert proto.newcomers[3] == {"replica": 3, "pid": 88, "why": "woken", "hello_at": 1.0, "started_at": 0.5,
                                  "attempts": 0}


def test_short_counts_members_and_newcomers():
    proto = machine(min_replicas=3)
    assert proto._short()
    proto.newcomers[2] = {}
    assert not proto._short()


def test_admit_names_the_fastest_member_as_donor_and_holds_the_newcomers_unhealed():
    proto = machine()
    proto.state = "waiting"
    proto.newcomers = {3: {"replica": 3, "why": "replacement", "attempts": 0},
                       2: {"replica": 2, "why": "woken", "attempts": 0}}
    out = proto._admit(5.0)  # no speeds measured yet: the lowest id donates
    assert proto.state == "running" and proto.gen == 3 and proto.members == [0, 1, 2, 3]
    assert proto.unhealed == {2, 3} and not proto.newcomers and set(proto.joining) == {2, 3}
    assert proto.joining[2]["donor"] == 0 and proto.joining[2]["generation"] == 3
    (admitted,) = [a.msg for a in out if a.kind == "event"]
    assert admitted["kind"] == "admitted" and admitted["replicas"] == [2, 3] and admitted["donor"] == 0
    gens = [a.msg for a in out if a.kind == "send"]
    assert len(gens) == 4 and all(g["t"] == "gen" and g["heal"]["donor"] == 0 for g in gens)
