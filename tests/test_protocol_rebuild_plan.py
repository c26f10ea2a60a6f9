"""core/coordinator/rebuild.py on its own: the pure classification and the records of a missed commit.

The end-to-end rebuild (a restarted coordinator driven to a commit) is in
tests/test_protocol_rebuild.py; here each piece of the module is checked directly:
- `classify_reports` names the generation that committed top-1 from `committed_vote`, so
  a member cut off after voting in a generation that never committed is stale, not behind;
- a malformed reported ledger is a `ProtocolError` (a worker's bug), not a fault;
- `_missed_commit` says `skipped` for a vote whose loss was not finite;
- `_rebuilt_commit_record` writes no line without a reported vote or for a skipped step,
  marks the line it writes "rebuilt", and refuses overlapping reported ledgers.
Pure: no processes.
"""
from __future__ import annotations

import pytest

from recover.core.coordinator import protocol, rebuild
from recover.core.coordinator.actions import Act, ProtocolError
from recover.core.coordinator.protocol import ProtocolStateMachine

M = 6


def _hello(step: int, gen: int, wait: str = "", vote: dict | None = None, committed_vote: dict | None = None) -> dict:
    return {"report": {"member": True, "step": step, "gen": gen, "ledger": [], "wait": wait, "vote": vote,
                       "committed_vote": committed_vote, "awaiting": None}}


def _vote(step: int, gen: int, ledger: list, loss_sum: float | None = 6.0) -> dict:
    return {"gen": gen, "step": step, "ledger": ledger, "loss_sum": loss_sum, "lr": 0.1}


def test_the_protocol_module_re_exports_the_rebuild_names():
    assert protocol.classify_reports is rebuild.classify_reports and protocol.RebuildPlan is rebuild.RebuildPlan
    assert issubclass(ProtocolStateMachine, rebuild.RebuildMixin)


def test_behind_means_voted_in_the_generation_that_committed():
    """Member 0 committed step 4 in generation 7; member 1 voted for step 4 in generation 6
    (which never committed) and member 2 in generation 7: only 2 missed a commit."""
    hellos = {0: _hello(5, 7, "gen", vote=_vote(5, 7, []), committed_vote=_vote(4, 7, [[0, 2]])),
              1: _hello(4, 6, "commit", vote=_vote(4, 6, [[2, 4]])),
              2: _hello(4, 7, "commit", vote=_vote(4, 7, [[2, 6]]))}
    plan = rebuild.classify_reports(hellos, replicas=3, step=0, recorded_step=None)
    assert plan.top == 5 and sorted(plan.ahead) == [0] and sorted(plan.behind) == [2] and plan.stale == [1]
    assert plan.recorded == -1 and plan.waiting == []


def test_a_malformed_reported_ledger_is_a_protocol_error():
    assert rebuild._ledger(0, {"ledger": [[0, 2]]}) == [[0, 2]]
    with pytest.raises(ProtocolError, match="replica 3 sent a malformed ledger"):
        rebuild._ledger(3, {"ledger": [[2, 1]]})


def test_a_missed_commit_of_a_non_finite_step_says_skipped():
    proto = ProtocolStateMachine(2, M, 10, join_timeout=30.0, now=0.0)
    assert proto._missed_commit(_vote(3, 1, [], loss_sum=12.0)) == {"loss": 12.0 / M}
    assert proto._missed_commit(_vote(3, 1, [], loss_sum=None)) == {"loss": None, "skipped": True}


def test_the_rebuilt_commit_record():
    proto = ProtocolStateMachine(2, M, 10, join_timeout=30.0, now=0.0)
    lo = 3 * M  # step 3's ids are [18, 24)
    assert proto._rebuilt_commit_record(3, {0: {"vote": _vote(2, 1, [])}}, 1.0) is None  # no vote of step 3
    skipped = {0: {"vote": _vote(3, 1, [[lo, lo + 3]], loss_sum=None)}}
    assert proto._rebuilt_commit_record(3, skipped, 1.0) is None  # a skipped step has no metrics line
    reports = {0: {"vote": _vote(3, 1, [[lo, lo + 3]])}, 1: {"committed_vote": _vote(3, 1, [[lo + 3, lo + 6]])}}
    line = proto._rebuilt_commit_record(3, reports, 1.0)
    assert line.kind is Act.COMMIT and line.msg["rebuilt"] and line.msg["complete"]
    assert line.msg["step"] == 3 and line.msg["loss"] == 1.0 and line.msg["microbatch_id_ranges"] == [[lo, lo + 6]]
    partial = proto._rebuilt_commit_record(3, {0: reports[0]}, 1.0)  # member 1 died since: its ids are missing
    assert partial.msg["rebuilt"] and not partial.msg["complete"]
    overlap = {0: reports[0], 1: {"vote": _vote(3, 1, [[lo + 2, lo + 6]])}}
    with pytest.raises(ProtocolError, match="overlap"):
        proto._rebuilt_commit_record(3, overlap, 1.0)
