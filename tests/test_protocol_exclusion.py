"""Persistent faults end in exclusion, not a livelock, on the real state machine.

`core.coordinator.protocol.ProtocolStateMachine` is driven directly with the messages a replica with a
broken link produces: it reports `fail` for every generation it is in while the
others rejoin with their ledgers. Before the fix, 50 such reports gave
generation 50, still at step 0, with the same members. Now the replica is fenced
after `fence_after` failed generations and the others commit; a failure that
singles no one out (every member reports it) ends in a clear stop after
`max_failed_generations` instead of going round for ever.
"""
from __future__ import annotations

from recover.core.contract import idranges
from recover.core.components.data import iteration_ids
from recover.core.coordinator.protocol import ProtocolStateMachine, Out
from recover.core.contract.step_messages import Vote
from recover.core.storage.results import expand_members, step_ids

from conftest import as_read

R, M = 3, 6


def formed(**kw) -> tuple[ProtocolStateMachine, dict[int, list]]:
    """Generation 0 of R replicas at step 0; every replica has folded its whole quota."""
    proto = ProtocolStateMachine(R, M, 4, join_timeout=1e9, now=0.0, **kw)
    quotas: dict[int, list] = {}
    for r in range(R):
        quotas.update({a.replica: as_read(a.msg, a.replica)["quota"] for a in proto.on_hello(r, {"tokens_per_mb": 1}, 0.0)
                       if a.kind == "send" and a.msg["t"] == "gen"})
    assert proto.gen == 0 and proto.members == [0, 1, 2]
    return proto, quotas


def failed_generation(proto: ProtocolStateMachine, reporters: list[int], ledgers: dict[int, list]) -> list[Out]:
    """`reporters` report the running generation's collective failed (first first); the
    members that are still expected rejoin with their ledgers."""
    outs: list[Out] = []
    for r in reporters:
        outs += proto.on_fail(r, {"gen": proto.gen, "step": proto.step, "reason": "allreduce failed: link"}, 0.0)
    if proto.state == "forming":
        nxt = proto.next_gen
        for r in sorted(proto.expected):
            outs += proto.on_join(r, {"gen": nxt, "step": proto.step, "ledger": ledgers[r]}, 0.0)
    return outs


def vote_all(proto: ProtocolStateMachine, ledgers: dict[int, list]) -> list[Out]:
    outs: list[Out] = []
    for r in proto.members:
        outs += proto.on_vote(r, Vote.from_wire({"gen": proto.gen, "step": proto.step, "ok": True, "ledger": ledgers[r],
                                                 "loss_sum": 0.0, "mb_seconds": 0.01}), 0.0)
    return outs


def test_a_replica_whose_collectives_keep_failing_is_fenced_and_the_others_commit():
    proto, ledgers = formed()
    for i in range(2):
        outs = failed_generation(proto, [2], ledgers)
        assert not [a for a in outs if a.msg.get("kind") == "fenced"]
        assert proto.gen == i + 1 and proto.members == [0, 1, 2]  # not yet: two failures may be bad luck
    outs = failed_generation(proto, [2], ledgers)  # the third in a row
    (fenced,) = [a for a in outs if a.msg.get("kind") == "fenced"]
    assert fenced.replica == 2 and fenced.msg["generations"] == [0, 1, 2]
    assert fenced.msg["reason"].startswith("replica 2 fenced: implicated in 3 consecutive failed generations")
    assert ("close", 2) in [(a.kind, a.replica) for a in outs]
    assert 2 in proto.dead and proto.gen == 3 and proto.members == [0, 1]
    # the fenced replica's folded ids died with it: they, and nothing else, are redone by the others
    gens = {a.replica: as_read(a.msg, a.replica) for a in outs if a.kind == "send" and a.msg["t"] == "gen"}
    assert set(gens) == {0, 1}
    redo = idranges.union_disjoint(m["quota"] for m in gens.values())
    assert redo == ledgers[2]
    ledgers = {r: idranges.union_disjoint([ledgers[r], gens[r]["quota"]]) for r in (0, 1)}
    commits = [expand_members(a.msg) for a in vote_all(proto, ledgers) if a.kind == "commit"]
    assert [c["step"] for c in commits] == [0] and step_ids(commits[0]) == iteration_ids(0, M)
    assert commits[0]["members"] == [0, 1]
    # its late messages are ignored: it never votes or rejoins again
    assert proto.on_fail(2, {"gen": proto.gen, "step": proto.step}, 0.0) == []


def test_fifty_failures_no_longer_give_generation_fifty_at_step_zero():
    """The issue's reproduction: before the fix the same members re-formed every time."""
    proto, ledgers = formed()
    for _ in range(50):
        if 2 not in proto.member_set:
            break
        failed_generation(proto, [2], ledgers)
    assert proto.members == [0, 1] and proto.gen == 3 and proto.state == "running"


def test_the_count_is_of_consecutive_failures_a_commit_or_another_culprit_resets_it():
    proto, ledgers = formed()
    failed_generation(proto, [2], ledgers)
    failed_generation(proto, [2], ledgers)
    assert any(a.kind == "commit" for a in vote_all(proto, ledgers))  # progress: the slate is clean
    ledgers = {r: [[M + 2 * r, M + 2 * r + 2]] for r in range(R)}
    failed_generation(proto, [2], ledgers)
    failed_generation(proto, [2], ledgers)
    failed_generation(proto, [0], ledgers)  # someone else first: 2's streak ends
    failed_generation(proto, [2], ledgers)
    failed_generation(proto, [2], ledgers)
    assert proto.members == [0, 1, 2] and not proto.dead
    outs = failed_generation(proto, [2], ledgers)
    assert [a.msg["generations"] for a in outs if a.msg.get("kind") == "fenced"] == [[5, 6, 7]]  # generation 2 committed step 0


def test_a_failure_explained_by_a_loss_or_reported_by_everyone_implicates_no_one():
    proto, ledgers = formed(fence_after=1)
    # a ring neighbour of a dead replica reports first; the death explains it
    outs = proto.on_fail(0, {"gen": 0, "step": 0, "reason": "Connection closed by peer"}, 0.0)
    outs += proto.on_lost(1, "control connection closed", 0.0)
    for r in sorted(proto.expected):
        outs += proto.on_join(r, {"gen": proto.next_gen, "step": 0, "ledger": ledgers[r]}, 0.0)
    assert not [a for a in outs if a.msg.get("kind") == "fenced"] and proto.members == [0, 2]
    # a symmetric fault: every member reports (0 first); nothing singles 0 out
    outs = failed_generation(proto, [0, 2], ledgers)
    assert not [a for a in outs if a.msg.get("kind") == "fenced"] and proto.members == [0, 2]
    # the same with 2 reporting alone: fenced at once (fence_after=1)
    outs = failed_generation(proto, [2], ledgers)
    assert [a.replica for a in outs if a.msg.get("kind") == "fenced"] == [2] and proto.members == [0]


def test_a_run_without_progress_stops_with_a_clear_error():
    """Every member reports every time (nothing to attribute): after N failed generations in a row
    the run stops, exit 1, naming why, instead of re-forming the same members for ever."""
    proto, ledgers = formed(max_failed_generations=5)
    for _ in range(4):
        outs = failed_generation(proto, [1, 0, 2], ledgers)
        assert proto.state == "running" and proto.members == [0, 1, 2]
    outs = failed_generation(proto, [1, 0, 2], ledgers)
    (finish,) = [a for a in outs if a.kind == "finish"]
    assert finish.code == 1 and proto.state == "finished"
    assert finish.reason.startswith("no progress: 5 consecutive generations failed without a commit (step 0")
    stops = {a.replica: a.msg for a in outs if a.kind == "send"}
    assert set(stops) == {0, 1, 2} and all(m["t"] == "stop" and "no progress" in m["reason"] for m in stops.values())
