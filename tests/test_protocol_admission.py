"""Admission of newcomers, on the real state machine, no processes.

`core.coordinator.protocol.ProtocolStateMachine` is driven with the messages a replacement or a woken
replica sends: a hello with `can_heal` for a dead replica's slot, the `healed`
report, a join saying the state never arrived. Checked: a newcomer enters only at
a commit, with a gen message naming the donor; quotas partition the step's ids
over the members and the newcomer; a failed transfer sends it back to waiting,
and the next admission picks another donor; a process fenced on evidence is
never readmitted, a new process in its slot is; `min_replicas` holds the next
step at the boundary until a newcomer arrives, or until the wait runs out.
"""
from __future__ import annotations

from recover.core.contract import idranges
from recover.core.components.data import iteration_ids
from recover.core.coordinator.protocol import ProtocolStateMachine, Out
from recover.core.contract.step_messages import Vote

from conftest import as_read

M = 6


def sends(outs: list[Out], t: str) -> dict[int, dict]:
    return {a.replica: as_read(a.msg, a.replica) for a in outs if a.kind == "send" and a.msg["t"] == t}


def formed(r: int = 3, **kw) -> ProtocolStateMachine:
    proto = ProtocolStateMachine(r, M, 10, join_timeout=1e9, now=0.0, **kw)
    for i in range(r):
        proto.on_hello(i, {"tokens_per_mb": 1, "pid": 100 + i, "can_heal": True}, 0.0)
    assert proto.gen == 0 and proto.state == "running"
    return proto


def vote_all(proto: ProtocolStateMachine, quotas: dict[int, list], now: float = 1.0) -> list[Out]:
    outs: list[Out] = []
    for r in list(proto.members):
        outs += proto.on_vote(r, Vote.from_wire({"gen": proto.gen, "step": proto.step, "ok": True,
                                                 "ledger": quotas.get(r, []),
                                                 "loss_sum": 1.0, "mb_seconds": 0.01, "weights_fingerprint": "w"}), now)
    return outs


def quotas_of(proto: ProtocolStateMachine) -> dict[int, list]:
    """An even split of the current step's ids (what gen/commit messages hand out)."""
    ids = iteration_ids(proto.step, M)
    k = len(proto.members)
    return {r: idranges.from_ids(ids[i::k]) for i, r in enumerate(proto.members)}


def lose(proto: ProtocolStateMachine, r: int) -> list[Out]:
    return proto.on_lost(r, "control connection closed (process gone)", 0.5)


def test_a_newcomer_is_admitted_only_at_the_next_commit_and_healed_by_a_member():
    proto = formed()
    lose(proto, 2)  # step 0 fails; 0 and 1 redo it
    for r in (0, 1):
        proto.on_join(r, {"gen": 1, "step": 0, "ledger": []}, 0.6)
    assert proto.members == [0, 1]
    out = proto.on_hello(2, {"tokens_per_mb": 1, "pid": 200, "can_heal": True, "started_at": 0.7}, 0.8)
    assert sends(out, "pending") == {2: {"t": "pending", "step": 0}}
    assert proto.members == [0, 1] and proto.gen == 1  # not inside step 0
    out = vote_all(proto, quotas_of(proto))
    commits, gens = sends(out, "commit"), sends(out, "gen")
    assert sorted(commits) == [0, 1] and all(c["next"] == 2 and c["quota"] == [] for c in commits.values())
    assert sorted(gens) == [0, 1, 2] and proto.gen == 2 and proto.step == 1
    heal = gens[2]["heal"]
    assert heal["donor"] in (0, 1) and idranges.to_ids(heal["joining"]) == [2]
    assert sorted(i for g in gens.values() for i in idranges.to_ids(g["quota"])) == iteration_ids(1, M)
    # the join record is written at the newcomer's first commit, with what it reported
    proto.on_healed(2, {"gen": 2, "step": 1, "donor": heal["donor"], "bytes": 1234, "seconds": 0.5,
                        "weights_fingerprint": "w"}, 1.1)
    quotas = {r: g["quota"] for r, g in gens.items()}
    out = vote_all(proto, quotas, now=2.0)
    (join,) = [a.msg for a in out if a.kind == "event" and a.msg.get("kind") == "join"]
    assert (join["replica"], join["why"], join["bytes"], join["first_commit_step"]) == (2, "replacement", 1234, 1)
    assert join["start_to_first_commit_seconds"] == 2.0 - 0.7
    assert join["member_digests"] == {"0": "w", "1": "w", "2": "w"}


def test_a_failed_transfer_sends_the_newcomer_back_and_the_next_admission_uses_another_donor():
    proto = formed()
    lose(proto, 2)
    for r in (0, 1):
        proto.on_join(r, {"gen": 1, "step": 0, "ledger": []}, 0.6)
    proto.on_hello(2, {"tokens_per_mb": 1, "pid": 200, "can_heal": True}, 0.8)
    gens = sends(vote_all(proto, quotas_of(proto)), "gen")
    donor = gens[2]["heal"]["donor"]
    other = 1 - donor
    lose(proto, donor)  # the donor dies during the transfer: generation 2 fails
    assert proto.state == "forming" and proto.expected == {other, 2}
    out = proto.on_join(2, {"gen": 3, "step": 1, "ledger": [], "healed": False}, 0.9)
    assert sends(out, "pending") == {2: {"t": "pending", "step": 1}}
    out = proto.on_join(other, {"gen": 3, "step": 1, "ledger": []}, 0.9)
    gens = sends(out, "gen")
    assert sorted(gens) == [other] and "heal" not in gens[other]  # the state never reached 2: it is out
    gens = sends(vote_all(proto, quotas_of(proto)), "gen")
    assert sorted(gens) == [other, 2] and gens[2]["heal"]["donor"] == other  # the retry, from the live member


def test_a_process_fenced_on_evidence_is_not_readmitted_but_a_new_one_in_its_slot_is():
    proto = formed()
    quotas = quotas_of(proto)
    outs = []
    for r in proto.members:  # replica 2's weights differ from the majority: fenced
        outs += proto.on_vote(r, Vote.from_wire({"gen": 0, "step": 0, "ok": True, "ledger": quotas[r], "loss_sum": 1.0,
                                                 "mb_seconds": 0.01,
                                                 "weights_fingerprint": "bad" if r == 2 else "w"}), 1.0)
    assert 2 in proto.dead and 2 in proto.banned
    again = proto.on_hello(2, {"tokens_per_mb": 1, "pid": 102, "can_heal": True, "rejoin": True}, 1.5)
    assert [a.kind for a in again] == ["close"] and 2 in proto.dead
    fresh = proto.on_hello(2, {"tokens_per_mb": 1, "pid": 999, "can_heal": True}, 1.6)
    assert sends(fresh, "pending") and 2 in proto.newcomers


def test_min_replicas_holds_the_next_step_at_the_boundary_until_a_newcomer_arrives():
    proto = formed(2, min_replicas=2)
    lose(proto, 1)
    proto.on_join(0, {"gen": 1, "step": 0, "ledger": []}, 0.6)
    out = vote_all(proto, quotas_of(proto))
    assert sends(out, "commit")[0]["next"] == 2 and sends(out, "pending") == {0: {"t": "pending", "step": 1}}
    assert proto.state == "waiting" and not sends(out, "gen")
    assert proto.on_tick(5.0) == []  # still within the wait
    out = proto.on_hello(1, {"tokens_per_mb": 1, "pid": 300, "can_heal": True, "rejoin": True}, 6.0)
    gens = sends(out, "gen")
    assert sorted(gens) == [0, 1] and gens[1]["heal"]["donor"] == 0 and proto.state == "running"


def test_min_replicas_waits_no_longer_than_the_start_up_timeout():
    proto = formed(2, min_replicas=2, startup_timeout=30.0)
    lose(proto, 1)
    proto.on_join(0, {"gen": 1, "step": 0, "ledger": []}, 0.6)
    vote_all(proto, quotas_of(proto), now=1.0)
    assert proto.state == "waiting"
    gens = sends(proto.on_tick(31.0), "gen")
    assert sorted(gens) == [0] and "heal" not in gens[0] and proto.gen == 2 and proto.step == 1


def test_a_newcomer_that_cannot_be_healed_is_refused_after_max_heal_attempts():
    """A state no donor can send (or no newcomer can load) fails every admission;
    `attempts` bounds it. After `max_heal_attempts` failed transfers the newcomer is refused with a
    record saying why, and never re-admitted as that process; a new process in the slot is a
    newcomer like any other (the launcher's replacement)."""
    proto = formed(max_heal_attempts=2)
    lose(proto, 2)
    for r in (0, 1):
        proto.on_join(r, {"gen": 1, "step": 0, "ledger": []}, 0.6)
    proto.on_hello(2, {"tokens_per_mb": 1, "pid": 200, "can_heal": True, "started_at": 0.7}, 0.8)
    for attempt in (1, 2):
        gens = sends(vote_all(proto, quotas_of(proto)), "gen")  # admitted at the commit ...
        assert sorted(gens) == [0, 1, 2] and "heal" in gens[2]
        donor = gens[2]["heal"]["donor"]
        out = proto.on_fail(donor, {"gen": proto.gen, "step": proto.step, "reason": "state transfer: TypeError"},
                            1.0)  # ... and the donor's transfer fails (it survives: a report, not a loss)
        assert sorted(sends(out, "abort")) == [0, 1, 2]
        out = proto.on_join(2, {"gen": proto.next_gen, "step": proto.step, "ledger": [], "healed": False}, 1.1)
        (failed,) = [a.msg for a in out if a.kind == "event" and a.msg["kind"] == "join_failed"]
        assert failed["attempts"] == attempt
        if attempt == 1:
            assert sends(out, "pending") == {2: {"t": "pending", "step": proto.step}} and 2 in proto.newcomers
        rejoined = []
        for r in (0, 1):  # the members redo the step without it
            rejoined += proto.on_join(r, {"gen": proto.next_gen, "step": proto.step, "ledger": []}, 1.2)
        assert sorted(sends(rejoined, "gen")) == [0, 1]
    (refused,) = [a.msg for a in out if a.kind == "event" and a.msg["kind"] == "join_refused"]
    assert (refused["replica"], refused["pid"], refused["attempts"]) == (2, 200, 2)
    assert "max-heal-attempts" in refused["reason"]
    assert [(a.replica, a.msg) for a in out if a.kind == "close"] == [(2, {"t": "refused"})]
    assert not sends(out, "pending") and 2 in proto.dead and 2 not in proto.newcomers and proto.banned[2] == 200
    # the members go on without it, and the next commit admits nobody
    out = vote_all(proto, quotas_of(proto))
    commits = sorted(a.replica for a in out if a.kind == "send" and a.msg["t"] == "commit")
    assert not sends(out, "gen") and commits == [0, 1] and proto.members == [0, 1]
    # the same process is not readmitted; a new one in the slot is
    assert [a.kind for a in proto.on_hello(2, {"tokens_per_mb": 1, "pid": 200, "can_heal": True}, 2.0)] == ["close"]
    assert sends(proto.on_hello(2, {"tokens_per_mb": 1, "pid": 201, "can_heal": True}, 2.1), "pending")
    assert proto.newcomers[2]["attempts"] == 0
