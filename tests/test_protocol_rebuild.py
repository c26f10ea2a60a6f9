"""A restarted coordinator rebuilds the run from its workers' reports, no processes.

A fresh `core.coordinator.protocol.ProtocolStateMachine` (what a coordinator started with `--rebuild`
holds) is handed the hellos the workers send it, each with the report
`core.worker.replica.Replica._report` builds, and is then driven to a commit. Checked:
- members at the same step hear an abort of their own generation and rejoin the
  next one with their ledgers; the redo quota is exactly the ids no one holds;
- members that voted and were waiting for a commit the old coordinator died in
  the middle of sending hear that commit (with `next`), and their join is
  implied; the commit's metrics line is written from the votes the workers
  report only when metrics.jsonl lacks it;
- a member behind or an unhealed one is closed (it comes back as a newcomer,
  healed from a member); a newcomer that was waiting for admission goes on
  waiting and is admitted at the next commit; with no member at all the run stops;
- the rebuilt generation's gen message asks for digested first votes, so a
  member off the majority is fenced before its gradient counts;
- the wire refuses a hello whose report is malformed.
"""
from __future__ import annotations

from recover.core.contract import idranges
from recover.core.components.data import iteration_ids
from recover.core.coordinator.protocol import ProtocolStateMachine, Out
from recover.core.contract.step_messages import Vote
from recover.core.contract.wire import parse_line, dumps
from recover.core.storage.results import expand_members, step_ids

from conftest import as_read

R, M, S = 3, 6, 10


def sends(outs: list[Out], t: str) -> dict[int, dict]:
    return {a.replica: as_read(a.msg, a.replica) for a in outs if a.kind == "send" and a.msg["t"] == t}


def hello(report: dict, pid: int = 100) -> dict:
    return {"t": "hello", "replica": 0, "token": "x", "pid": pid, "tokens_per_mb": 2, "report": report}


def report(step: int, gen: int, ledger: list[int] = (), wait: str = "", awaiting: int | None = None,
           vote: dict | None = None, member: bool = True, committed_vote: dict | None = None) -> dict:
    return {"member": member, "step": step, "gen": gen, "ledger": idranges.from_ids(list(ledger)), "wait": wait,
            "awaiting": awaiting, "vote": vote, "committed_vote": committed_vote}


def vote_of(step: int, gen: int, ledger: list[int], loss_sum: float = 12.0) -> dict:
    return {"gen": gen, "step": step, "ledger": idranges.from_ids(ledger), "loss_sum": loss_sum, "lr": 0.1}


def fresh() -> ProtocolStateMachine:
    return ProtocolStateMachine(R, M, S, join_timeout=1e9, now=0.0)


def vote_all(proto: ProtocolStateMachine, ledgers: dict[int, list], now: float,
             digests: dict[int, str] | None = None) -> list[Out]:
    """Every member votes the ledger given for it."""
    out: list[Out] = []
    for r in list(proto.members):
        msg = {"gen": proto.gen, "step": proto.step, "ok": True, "ledger": ledgers[r], "loss_sum": 6.0,
               "mb_seconds": 0.01, "lr": 0.1}
        if digests is not None:
            msg["weights_fingerprint"] = digests[r]
        out += proto.on_vote(r, Vote.from_wire(msg), now)
    return out



def test_members_at_one_step_are_aborted_into_a_new_generation_with_their_ledgers_kept():
    ids = iteration_ids(4, M)  # 24..29
    hellos = {
        0: hello(report(4, 2, ids[0:2])),  # folding step 4 of generation 2
        1: hello(report(4, 2, ids[2:3], wait="commit", vote=vote_of(4, 2, ids[2:3]))),  # voted at 4, nothing came
        2: hello(report(4, 2, ids[3:4], wait="gen", awaiting=3)),  # already joined generation 3 after an abort
    }
    proto = fresh()
    out = proto.rebuild(hellos, 5.0, recorded_step=3)
    aborts = sends(out, "abort")
    assert set(aborts) == {0, 1} and all(a["gen"] == 2 and a["step"] == 4 and a["next"] == 4 for a in aborts.values())
    assert not sends(out, "commit") and not [a for a in out if a.kind == "commit"]
    assert proto.state == "forming" and proto.step == 4 and proto.joins == {2: [[27, 28]]}
    out = proto.on_join(0, {"gen": 4, "step": 4, "ledger": idranges.from_ids(ids[0:2])}, 5.1)
    out += proto.on_join(1, {"gen": 4, "step": 4, "ledger": idranges.from_ids(ids[2:3])}, 5.1)
    gens = sends(out, "gen")
    assert set(gens) == {0, 1, 2} and all(g["gen"] == 4 and g["digest"] is True for g in gens.values())
    handed = sorted(i for g in gens.values() for i in idranges.to_ids(g["quota"]))
    assert handed == ids[4:]  # exactly the ids no member holds
    # the commit that follows is an ordinary one, and its recovery record names the restart
    # each member votes what it kept plus the redo quota it was handed
    ledgers = {r: idranges.from_ids(sorted(set(idranges.to_ids(gens[r]["quota"]))
                                           | set(idranges.to_ids(hellos[r]["report"]["ledger"]))))
               for r in range(R)}
    out = vote_all(proto, ledgers, 6.0)
    (rec,) = [a.msg for a in out if a.kind == "recovery"]
    assert rec["fault"].startswith("coordinator restarted") and rec["generation"] == 4 and rec["step"] == 4
    (commit,) = [expand_members(a.msg) for a in out if a.kind == "commit"]
    assert commit["step"] == 4 and step_ids(commit) == ids


def test_members_that_missed_a_commit_hear_it_and_its_line_is_written_from_the_reported_votes():
    prev, ids = iteration_ids(6, M), iteration_ids(7, M)
    split = {0: prev[0:2], 1: prev[2:4], 2: prev[4:6]}
    hellos = {  # the old coordinator sent step 6's commit to replica 0 only, then died
        0: hello(report(7, 5, ids[0:1], vote=vote_of(6, 5, split[0]))),
        1: hello(report(6, 5, [], wait="commit", vote=vote_of(6, 5, split[1]))),
        2: hello(report(6, 5, [], wait="commit", vote=vote_of(6, 5, split[2]))),
    }
    proto = fresh()
    out = proto.rebuild(hellos, 9.0, recorded_step=5)
    commits = sends(out, "commit")
    assert set(commits) == {1, 2}
    assert all(c == {"t": "commit", "gen": 5, "step": 6, "loss": 2.0, "quota": [], "next": 6} for c in commits.values())
    assert set(sends(out, "abort")) == {0}
    (line,) = [expand_members(a.msg) for a in out if a.kind == "commit"]
    assert line["step"] == 6 and step_ids(line) == prev and line["rebuilt"] and line["complete"]
    assert line["loss"] == 2.0 and line["generation"] == 5 and line["tokens"] == M * 2
    # recorded already: no second line for step 6
    again = fresh().rebuild(hellos, 9.0, recorded_step=6)
    assert not [a for a in again if a.kind == "commit"]
    # 1 and 2 joined by hearing the commit; replica 0's join forms generation 6 at step 7
    out = proto.on_join(0, {"gen": 6, "step": 7, "ledger": idranges.from_ids(ids[0:1])}, 9.1)
    gens = sends(out, "gen")
    assert set(gens) == {0, 1, 2} and proto.step == 7
    assert sorted(i for g in gens.values() for i in idranges.to_ids(g["quota"])) == ids[1:]


def test_a_member_behind_and_an_unhealed_one_are_closed_and_come_back_as_newcomers():
    ids = iteration_ids(5, M)
    hellos = {
        0: hello(report(5, 4, ids[0:2])),
        1: hello(report(3, 2, [])),  # behind by two steps: it cannot hold step 5's state
        2: hello(report(5, 4, [], member=False)),  # admitted, state not arrived
    }
    proto = fresh()
    out = proto.rebuild(hellos, 2.0)
    closed = sorted(a.replica for a in out if a.kind == "close")
    assert closed == [1, 2] and proto.dead == {1, 2} and proto.expected == {0}
    # the one left rejoins alone and gets everything it lacks
    out = proto.on_join(0, {"gen": 5, "step": 5, "ledger": idranges.from_ids(ids[0:2])}, 2.1)
    assert idranges.to_ids(sends(out, "gen")[0]["quota"]) == ids[2:]
    # replica 1 says hello again (its reconnect after the close): admitted at the next commit
    out = proto.on_hello(1, {"pid": 101, "can_heal": True, "rejoin": True}, 2.2)
    assert sends(out, "pending") == {1: {"t": "pending", "step": 5}}


def test_a_newcomer_waiting_for_admission_goes_on_waiting_and_is_admitted_at_the_next_commit():
    """A replacement (or a woken replica that rejoined) was waiting for admission
    when the coordinator died. It reports no generation; closing it would make it exit (a process
    in no generation takes the close for a verdict). It hears "pending" instead, and the restarted
    coordinator admits it at its first commit, healed from a member."""
    ids = iteration_ids(4, M)
    hellos = {0: hello(report(4, 3, ids[0:3])), 1: hello(report(4, 3, ids[3:6], wait="commit",
                                                                  vote=vote_of(4, 3, ids[3:6])))}
    hellos[2] = {**hello(report(2, -1, [], wait="gen", awaiting=0, member=False), pid=300),
                 "can_heal": True, "rejoin": False, "started_at": 3.5}
    proto = fresh()
    out = proto.rebuild(hellos, 5.0, recorded_step=3)
    assert not [a for a in out if a.kind == "close"] and sends(out, "pending") == {2: {"t": "pending", "step": 4}}
    (event,) = [a.msg for a in out if a.kind == "event"]
    assert event["newcomers"] == [2] and event["closed"] == [] and event["members"] == [0, 1]
    assert 2 in proto.alive and 2 in proto.newcomers and proto.expected == {0, 1}
    gens = sends(proto.on_join(0, {"gen": 4, "step": 4, "ledger": idranges.from_ids(ids[0:3])}, 5.1)
                 + proto.on_join(1, {"gen": 4, "step": 4, "ledger": idranges.from_ids(ids[3:6])}, 5.1), "gen")
    assert set(gens) == {0, 1}  # step 4 is finished by the members ...
    out = vote_all(proto, {0: idranges.from_ids(ids[0:3]), 1: idranges.from_ids(ids[3:6])}, 6.0)
    gens = sends(out, "gen")  # ... and the newcomer enters at the commit, healed by a member
    assert set(gens) == {0, 1, 2} and gens[2]["step"] == 5 and gens[2]["heal"]["donor"] in (0, 1)
    assert idranges.to_ids(gens[2]["heal"]["joining"]) == [2]
    (admitted,) = [a.msg for a in out if a.kind == "event" and a.msg.get("kind") == "admitted"]
    assert admitted["replicas"] == [2]
    assert proto.joining[2]["why"] == "replacement" and proto.joining[2]["started_at"] == 3.5


def test_no_member_reporting_stops_the_run_saying_why():
    out = fresh().rebuild({2: hello(report(0, -1, [], member=False))}, 1.0)
    (fin,) = [a for a in out if a.kind == "finish"]
    assert fin.code == 1 and "cannot rebuild" in fin.reason and "no member" in fin.reason


def test_the_rebuilt_generation_fences_a_member_whose_weights_are_off_the_majority():
    ids = iteration_ids(2, M)
    hellos = {r: hello(report(2, 1, [])) for r in range(R)}
    proto = fresh()
    proto.rebuild(hellos, 1.0)
    out = []
    for r in range(R):
        out += proto.on_join(r, {"gen": 2, "step": 2, "ledger": []}, 1.1)
    gens = sends(out, "gen")
    assert all(g["digest"] for g in gens.values())
    out = vote_all(proto, {r: gens[r]["quota"] for r in range(R)}, 1.5, digests={0: "a", 1: "a", 2: "b"})
    fenced = [a.msg for a in out if a.kind == "event" and a.msg.get("kind") == "fenced"]
    assert [f["replica"] for f in fenced] == [2] and not [a for a in out if a.kind == "commit"]
    # the step is redone by the two whose weights agree: replica 2's ids go back to them
    assert proto.state == "forming" and proto.expected == {0, 1} and 2 in proto.dead
    assert sorted(i for g in gens.values() for i in idranges.to_ids(g["quota"])) == ids


def test_a_commit_everyone_heard_but_no_one_recorded_is_written_from_the_committed_votes():
    """The old coordinator sent step 6's commit to every member and was killed before writing its
    line (it sends, then records); the members went on, voted at 7 and wait. The line for step 6
    comes from each member's report of the vote it committed, and only when metrics.jsonl lacks it."""
    prev, ids = iteration_ids(6, M), iteration_ids(7, M)
    hellos = {r: hello(report(7, 5, ids[2 * r:2 * r + 2], wait="commit", vote=vote_of(7, 5, ids[2 * r:2 * r + 2]),
                              committed_vote=vote_of(6, 5, prev[2 * r:2 * r + 2])))
              for r in range(R)}
    out = fresh().rebuild(hellos, 9.0, recorded_step=5)
    (line,) = [expand_members(a.msg) for a in out if a.kind == "commit"]
    assert line["step"] == 6 and step_ids(line) == prev and line["rebuilt"] and line["complete"]
    assert line["loss"] == 2.0 and sorted(map(int, line["ledgers"])) == [0, 1, 2]
    assert set(sends(out, "abort")) == {0, 1, 2} and not sends(out, "commit")  # step 7 restarts, ledgers kept
    assert not [a for a in fresh().rebuild(hellos, 9.0, recorded_step=6) if a.kind == "commit"]
    # workers that predate the field report no committed vote: no line, and the rebuild goes on
    old = {r: hello({k: v for k, v in h["report"].items() if k != "committed_vote"}) for r, h in hellos.items()}
    out = fresh().rebuild(old, 9.0, recorded_step=5)
    assert not [a for a in out if a.kind == "commit"] and set(sends(out, "abort")) == {0, 1, 2}


def test_a_coordinator_killed_after_sending_the_last_commit_ends_the_run_with_its_line_written():
    """Step S-1's commit went out (to replica 0 only, then to everyone), and the old coordinator died
    before writing its line. The members that heard it finished and wait for `done`: nothing is left
    to run, so the rebuild forms no generation. It writes the line, gives the members that missed the
    commit the last commit (no quota, no next generation) and says done to every worker that reported,
    a newcomer too."""
    last = iteration_ids(S - 1, M)
    split = {r: last[2 * r:2 * r + 2] for r in range(R)}
    finished = {r: hello(report(S, 5, committed_vote=vote_of(S - 1, 5, split[r]), vote=vote_of(S - 1, 5, split[r])))
                for r in range(R)}
    waiting = {r: hello(report(S - 1, 5, wait="commit", vote=vote_of(S - 1, 5, split[r]))) for r in (1, 2)}
    for hellos, missed in (({0: finished[0], **waiting}, [1, 2]), (finished, [])):
        proto = fresh()
        out = proto.rebuild(hellos, 9.0, recorded_step=S - 2)
        (line,) = [expand_members(a.msg) for a in out if a.kind == "commit"]
        assert line["step"] == S - 1 and step_ids(line) == last and line["rebuilt"] and line["complete"]
        assert sends(out, "commit") == {r: {"t": "commit", "gen": 5, "step": S - 1, "loss": 2.0, "quota": []}
                                        for r in missed}
        assert set(sends(out, "done")) == {0, 1, 2} and not sends(out, "abort") and not sends(out, "gen")
        (event,) = [a.msg for a in out if a.kind == "event"]
        assert event["finished"] and event["missed_commit"] == missed and event["step"] == S
        assert [(a.code, a.reason) for a in out if a.kind == "finish"] == [(0, "all steps committed")]
        assert proto.state == "finished"
    # the line was written before the kill (it died before `done`): only done, and no second line
    out = fresh().rebuild(finished, 9.0, recorded_step=S - 1)
    assert not [a for a in out if a.kind == "commit"] and set(sends(out, "done")) == {0, 1, 2}
    # a newcomer that reported at the end hears done with the members
    newcomer = hello(report(0, -1, member=False))
    out = fresh().rebuild({0: finished[0], 1: finished[1], 2: newcomer}, 9.0, recorded_step=S - 1)
    assert set(sends(out, "done")) == {0, 1, 2}


def test_the_wire_checks_a_hellos_report():
    good = hello(report(3, 1, [18, 19], wait="commit", vote=vote_of(3, 1, [18, 19])))
    assert parse_line(dumps(good))[0] is not None
    for broken in ({"member": True}, {**good["report"], "step": "3"}, {**good["report"], "ledger": [[5, 2]]},
                   {**good["report"], "vote": {"gen": 1}}, {**good["report"], "awaiting": 1.5}, [],
                   {**good["report"], "committed_vote": {"gen": 1, "step": "2"}}):
        msg, why = parse_line(dumps({**good, "report": broken}))
        assert msg is None and "report" in why


def test_a_report_past_what_metrics_allows_is_set_aside_not_believed():
    # metrics.jsonl holds steps up to 5: no member can be past step 7 (6 sent, not recorded)
    ids = iteration_ids(6, M)
    hellos = {0: hello(report(6, 3, ids[0:2])), 1: hello(report(6, 3, ids[2:4])), 2: hello(report(40, 3, []))}
    proto = fresh()
    out = proto.rebuild(hellos, 1.0, recorded_step=5)
    assert proto.step == 6 and proto.expected == {0, 1}
    assert [a.replica for a in out if a.kind == "close"] == [2]  # it comes back as a newcomer, healed


def test_a_restarted_coordinator_reads_the_last_recorded_step_from_the_tail_and_ends_a_torn_line(
        tmp_path, monkeypatch):
    import json

    import recover.core.coordinator.service as membership

    path = tmp_path / "metrics.jsonl"
    lines = "".join(json.dumps({"step": s, "pad": "x" * 100}) + "\n" for s in range(50))
    path.write_text(lines + '{"step": 50, "lo')  # killed mid-write
    assert membership.CoordinatorService._last_recorded_step(path) == 49
    writer = membership.HeldLineWriter(path)  # the restarted coordinator's metrics writer
    assert writer.write({"step": 50}) and writer.close()
    assert path.read_text().endswith('"lo\n{"step": 50}\n')  # the next record starts a line of its own
    monkeypatch.setattr(membership, "TAIL_BYTES", 300)  # only the tail is read: a few lines
    path.write_text(lines)
    assert membership.CoordinatorService._last_recorded_step(path) == 49
    assert membership.CoordinatorService._last_recorded_step(tmp_path / "absent.jsonl") == -1


def test_a_member_cut_off_after_voting_in_a_generation_that_never_committed_is_not_handed_that_commit():
    """Step 6 ran in generation 5; replica 2 voted in it and was then cut off (a
    partition: declared dead, it never read the close). Generation 6 (0 and 1) redid its share and
    committed step 6; 0 and 1 then voted at step 7, and the coordinator died. Replica 2 reports it is
    still waiting for the commit of step 6, with its vote of generation 5. That vote never committed:
    the members past step 6 committed it in generation 6, as their `committed_vote` says (their last
    vote is of step 7, so a filter built from it is empty and lets any old vote through). Replica 2
    is closed (it comes back as a newcomer, healed), never handed generation 5's commit."""
    prev, ids = iteration_ids(6, M), iteration_ids(7, M)
    hellos = {r: hello(report(7, 6, ids[3 * r:3 * r + 3], wait="commit", vote=vote_of(7, 6, ids[3 * r:3 * r + 3]),
                              committed_vote=vote_of(6, 6, prev[3 * r:3 * r + 3])))
              for r in (0, 1)}
    hellos[2] = hello(report(6, 5, [], wait="commit", vote=vote_of(6, 5, prev[4:6])))
    proto = fresh()
    out = proto.rebuild(hellos, 9.0, recorded_step=6)
    assert not sends(out, "commit")  # nobody is handed a commit of step 6
    assert [a.replica for a in out if a.kind == "close"] == [2] and proto.expected == {0, 1}
    (event,) = [a.msg for a in out if a.kind == "event"]
    assert event["missed_commit"] == [] and event["closed"] == [2]
    assert set(sends(out, "abort")) == {0, 1}
    # a member that did miss generation 6's commit still hears it
    hellos[2] = hello(report(6, 6, [], wait="commit", vote=vote_of(6, 6, prev[4:6])))
    out = fresh().rebuild(hellos, 9.0, recorded_step=6)
    assert set(sends(out, "commit")) == {2} and sends(out, "commit")[2]["gen"] == 6


def test_the_reports_are_classified_alone_before_anything_is_decided():
    """`classify_reports`: who is ahead, behind (voted, missed the commit),
    waiting for admission, or stale, from the hellos alone; no state machine involved."""
    from recover.core.coordinator.protocol import classify_reports

    def report(step, wait="", vote_step=None, gen=0, member=True):
        vote = None if vote_step is None else {"gen": gen, "step": vote_step, "ledger": [], "loss_sum": 1.0}
        return {"report": {"member": member, "step": step, "gen": gen, "ledger": [], "wait": wait, "vote": vote,
                           "awaiting": None}}

    hellos = {0: report(5, "gen", vote_step=4), 1: report(4, "commit", vote_step=4),
              2: report(3, "commit", vote_step=3),  # two behind: it holds nothing anyone can finish
              3: {"can_heal": True, "report": {"member": False, "step": 0, "gen": -1, "ledger": [], "wait": ""}},
              4: report(40)}  # past what metrics.jsonl allows: a worker's bug, set aside
    plan = classify_reports(hellos, replicas=5, step=0, recorded_step=3)
    assert (plan.top, sorted(plan.ahead), sorted(plan.behind)) == (5, [0], [1])
    assert plan.waiting == [3] and plan.stale == [2, 4] and plan.recorded == 3
    assert classify_reports({3: hellos[3]}, 5, 0, None).members == {}  # no member: nothing to rebuild
