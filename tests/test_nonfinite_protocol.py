"""A non-finite loss in the state machine, on the wire and in the worker's record.

Pure: the real `ProtocolStateMachine` driven with explicit times, `wire.parse_line` on the bytes
a worker sends, `NonfiniteLosses` and `CommittedStep.skip` in-process.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from recover.core.contract import idranges
from recover.core.config.train_config import ConfigError, TrainConfig
from recover.core.contract.nonfinite import NonfiniteLosses, describe, vote_fields
from recover.core.coordinator.protocol import ProtocolStateMachine
from recover.core.contract.step_messages import Ready, Vote
from recover.core.worker.recipe import CommittedStep
from recover.core.contract.wire import _vote_ok, parse_line

from conftest import as_read

R, M, S = 2, 4, 4


def formed(on_nonfinite: str = "stop", steps: int = S) -> tuple[ProtocolStateMachine, dict[int, list]]:
    proto = ProtocolStateMachine(R, M, steps, join_timeout=1.0, now=0.0, on_nonfinite=on_nonfinite)
    quotas = {}
    for r in range(R):
        quotas.update({a.replica: as_read(a.msg, a.replica)["quota"] for a in proto.on_hello(r, {"tokens_per_mb": 1}, 0.0)
                       if a.kind == "send" and a.msg["t"] == "gen"})
    return proto, quotas


def vote(proto: ProtocolStateMachine, r: int, ledger, now: float, loss_sum=1.0, nonfinite=None) -> list:
    proto.on_ready(r, Ready.from_wire({"gen": proto.gen, "step": proto.step}), now)
    msg = {"t": "vote", "gen": proto.gen, "step": proto.step, "ok": True, "ledger": ledger, "loss_sum": loss_sum,
           "mb_seconds": 0.1, "lr": 0.01}
    if nonfinite is not None:
        msg["nonfinite"] = nonfinite
    # what the coordinator reads is what survives the wire
    parsed, why = parse_line(json.dumps(msg, allow_nan=False).encode())
    assert parsed is not None, why
    return proto.on_vote(r, Vote.from_wire(parsed), now)


def step_ids(step: int, r: int) -> list:
    lo = step * M + r * (M // R)
    return [[lo, lo + M // R]]


def commit_step(proto: ProtocolStateMachine, now: float) -> list:
    out = vote(proto, 0, step_ids(proto.step, 0), now)
    return out + vote(proto, 1, step_ids(proto.step, 1), now)


def test_stop_names_the_step_replica_and_ids_and_keeps_what_was_committed():
    proto, _ = formed("stop")
    assert [a.kind for a in commit_step(proto, 1.0)].count("commit") == 1  # step 0 committed
    # step 1: replica 1 folded id 6 with a NaN loss; every member's reduced loss sum is NaN
    assert vote(proto, 0, step_ids(1, 0), 2.0, loss_sum=None) == []  # waits for every vote
    out = vote(proto, 1, step_ids(1, 1), 2.0, loss_sum=None, nonfinite=[[6, 7]])
    assert not [a for a in out if a.kind == "commit"]  # nothing of the step is committed
    (rec,) = [a.msg for a in out if a.kind == "event"]
    assert rec["kind"] == "nonfinite" and rec["step"] == 1 and rec["action"] == "stop"
    assert rec["nonfinite"] == {"1": [[6, 7]]} and rec["microbatch_ids"] == [6]
    stops = {a.replica: a.msg for a in out if a.kind == "send"}
    assert set(stops) == {0, 1} and all(m["t"] == "stop" and m["committed"] == 1 for m in stops.values())
    (fin,) = [a for a in out if a.kind == "finish"]
    assert fin.code == 1 and proto.state == "finished"
    assert "step 1" in fin.reason and "replica 1: microbatch(es) [6]" in fin.reason
    assert "non-finite" in fin.reason and "before 1 are committed" in fin.reason


def test_skip_drops_the_step_and_the_next_goes_on_with_its_own_ids():
    proto, _ = formed("skip")
    commit_step(proto, 1.0)
    vote(proto, 0, step_ids(1, 0), 2.0, loss_sum=None, nonfinite=[[4, 5]])
    out = vote(proto, 1, step_ids(1, 1), 2.0, loss_sum=None)
    assert not [a for a in out if a.kind in ("commit", "finish")]  # no metrics line, the run goes on
    (rec,) = [a.msg for a in out if a.kind == "event"]
    assert rec["action"] == "skip" and rec["step"] == 1 and rec["microbatch_ids"] == [4]
    sent = {a.replica: as_read(a.msg, a.replica, proto.member_ranges) for a in out if a.kind == "send"}
    assert set(sent) == {0, 1}
    for r, m in sent.items():
        assert m["t"] == "commit" and m["skipped"] is True and m["loss"] is None and m["step"] == 1
        assert m["quota"] == step_ids(2, r)  # step 2's own ids
    assert proto.step == 2 and proto.skipped == [1]
    # step 2 commits as usual; the last step ends the run, naming the skipped one
    assert [a.msg["step"] for a in commit_step(proto, 3.0) if a.kind == "commit"] == [2]
    out = commit_step(proto, 4.0)
    (fin,) = [a for a in out if a.kind == "finish"]
    assert fin.code == 0 and "[1] skipped" in fin.reason


def test_a_null_loss_sum_without_named_ids_still_stops_and_says_so():
    proto, _ = formed("stop")
    vote(proto, 0, step_ids(0, 0), 1.0, loss_sum=None)
    out = vote(proto, 1, step_ids(0, 1), 1.0, loss_sum=None)
    (fin,) = [a for a in out if a.kind == "finish"]
    assert fin.code == 1 and "no replica named a microbatch" in fin.reason


def test_a_skipped_step_that_a_member_missed_is_heard_as_skipped_after_a_rebuild():
    def report(step, ledger, wait="", vote=None):
        return {"member": True, "step": step, "gen": 0, "ledger": ledger, "wait": wait, "awaiting": None,
                "vote": vote, "committed_vote": None}
    skipped_vote = {"gen": 0, "step": 1, "ledger": [[6, 8]], "loss_sum": None, "lr": 0.01}
    hellos = {0: {"pid": 1, "report": report(2, [], vote={**skipped_vote, "ledger": [[4, 6]]})},
              1: {"pid": 2, "report": report(1, [], wait="commit", vote=skipped_vote)}}
    # the report travels in a hello: a null loss sum in its vote is accepted on the wire
    line = json.dumps({"t": "hello", "replica": 1, "token": "x", **hellos[1]}, allow_nan=False).encode()
    assert parse_line(line)[0] is not None
    proto = ProtocolStateMachine(R, M, S, join_timeout=1.0, now=0.0, on_nonfinite="skip")
    out = proto.rebuild(hellos, 5.0, recorded_step=0)
    (c,) = [a.msg for a in out if a.kind == "send" and a.msg["t"] == "commit"]
    assert c["skipped"] is True and c["loss"] is None and c["step"] == 1
    assert not [a for a in out if a.kind == "commit"]  # a skipped step has no metrics line to rewrite


def test_the_wire_field():
    base = {"t": "vote", "gen": 0, "step": 1, "ok": True, "ledger": [[4, 8]], "mb_seconds": 0.1, "lr": 0.01}
    good = {**base, "loss_sum": None, "nonfinite": [[5, 6]]}
    assert parse_line(json.dumps(good).encode()) == (good, "")
    assert not _vote_ok(good)  # the fast path leaves it to the tables
    for bad in ([5], [[6, 5]], "5", [[5, 6.0]]):
        msg, why = parse_line(json.dumps({**good, "nonfinite": bad}).encode())
        assert msg is None and "nonfinite" in why
    # what the old worker sent (NaN as json writes it) is refused as malformed: the worker must not
    msg, why = parse_line(json.dumps({**base, "loss_sum": float("nan")}).encode())
    assert msg is None and "malformed" in why


def test_the_workers_record_follows_the_ledger():
    losses = NonfiniteLosses()
    for i, loss in [(4, 1.0), (5, math.nan), (6, math.inf), (7, 2.0)]:
        losses.record(i, loss)
    assert vote_fields(math.nan, [4, 5, 6, 7], losses) == {"loss_sum": None, "nonfinite": [[5, 7]]}
    losses.record(6, 0.5)  # discarded and folded again, finite this time
    assert losses.in_ledger([4, 5, 6, 7]) == [[5, 6]]
    assert losses.in_ledger([8, 9]) == []  # a new step's ledger: the old ids are gone
    assert vote_fields(3.0, [8, 9], losses) == {"loss_sum": 3.0}
    assert describe(3, 1, {0: [[5, 6]], 2: [[9, 11]]}) == (
        "step 3 (generation 1): non-finite loss at replica 0: microbatch(es) [5]; replica 2: microbatch(es) [9, 10]")


def test_a_skipped_step_keeps_the_weights_and_moves_the_schedule_on():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 10)
    stepper = CommittedStep(opt, list(model.parameters()), sched)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    stepper.skip(0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert stepper.committed == 1 and stepper.lr(1) == pytest.approx(0.1 * 2 / 10)


def test_the_flag():
    assert TrainConfig().on_nonfinite == "stop"
    with pytest.raises(ConfigError, match="--on-nonfinite"):
        TrainConfig(on_nonfinite="ignore").validate()
    with pytest.raises(ValueError):
        ProtocolStateMachine(2, 4, 1, join_timeout=1.0, now=0.0, on_nonfinite="ignore")
