"""A member holding the join token sends a bad vote.

`recover train --system recover --replicas 3` on the tiny model, with a `bad_vote` fault:
replica 1's vote at step 3 goes out without its loss_sum (the fault injector's
`outgoing_vote` hook drops it; the worker is otherwise honest). Before the wire checked votes,
this crashed the coordinator (a TypeError out of `_commit`) and so the run. Now the sender
is fenced, with a "fenced" record naming why; the other members redo its ids; every step
folds exactly its M ids; the losses are the failure-free run's (the plain trainer, same
seed); and the coordinator ends the run normally (run_end, code 0).
"""
from __future__ import annotations

import json

import pytest
from conftest import assert_every_planned_fault_fired, load_run, run_recover

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, reported_ids

pytestmark = pytest.mark.procs

R, M, STEPS, SEED, BAD_STEP = 3, 6, 8, 11, 3
LOSS_RTOL = 1e-5  # as tests/test_resilient.py: only the summation order of the gradient differs
COMMON = ["--replicas", str(R), "--microbatches", str(M), "--steps", str(STEPS), "--seed", str(SEED),
          "--heartbeat-timeout", "3", "--collective-timeout", "20", "--no-progress"]


def test_a_members_vote_without_loss_sum_fences_it_and_the_run_goes_on(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "bad_vote", "replica": 1, "step": BAD_STEP, "phase": "vote"}]}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", *COMMON, "--faults", str(plan), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "logs" / "coordinator.log").read_text()
    fired = assert_every_planned_fault_fired(out)
    assert [(f["kind"], f["replica"], f["step"]) for f in fired] == [("bad_vote", 1, BAD_STEP)]

    events = read_jsonl(out / "events.jsonl")
    fenced = [e for e in events if e["kind"] == "fenced"]
    assert [e["replica"] for e in fenced] == [1], fenced
    assert "loss_sum" in json.dumps(fenced[0]), fenced[0]  # the record says why: the vote's missing field
    assert events[-1]["kind"] == "run_end" and events[-1]["code"] == 0, events[-1]  # the coordinator did not crash

    _, metrics, _ = load_run(out)
    reference = [m["loss"] for m in load_run(_plain(tmp_path))[1]]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference):
        assert reported_ids(m) == iteration_ids(m["step"], M)  # exactly its M ids, each once
        assert sorted(map(int, m["ledgers"])) == m["members"]
        assert abs(m["loss"] - ref) <= LOSS_RTOL * abs(ref), (m["step"], m["loss"], ref)
    bad = next(m for m in metrics if m["step"] == BAD_STEP)
    assert 1 not in bad["members"], bad["members"]  # its vote never counted: the others redid its ids
    assert all(m["members"] == [0, 1, 2] for m in metrics if m["step"] < BAD_STEP)


def _plain(tmp_path):
    out = tmp_path / "plain"
    run_recover("train", "--system", "plain", *COMMON, "--replicas", "1", "--out", str(out), check=True)
    return out
