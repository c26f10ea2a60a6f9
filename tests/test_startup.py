"""Start-up: a replica lost before its hello does not sink the job.

The pure half drives `protocol.ProtocolStateMachine`: a launcher's exit notice for a replica
that never said hello drops it at once and generation 0 forms with the others; the
answer to a hello tells the worker the time left of the coordinator's start-up
deadline (one source for both waits). The process half SIGKILLs a worker by PID
right after it is spawned (a launcher-fired fault at 0 s: the worker is still
importing torch), and the run must complete with the other replicas, with the
failure-free trajectory and a record naming the exit.
"""
from __future__ import annotations

import json

import pytest

from conftest import as_read, load_run, run_recover

from recover.core.contract import env_names, idranges
from recover.core.components.data import iteration_ids
from recover.core.coordinator.protocol import ProtocolStateMachine
from recover.core.storage.results import read_jsonl, step_ids

LOSS_RTOL = 1e-5  # as in test_resilient.py: summation order only


def _sends(out, kind):
    return {a.replica: as_read(a.msg, a.replica) for a in out if a.kind == "send" and a.msg["t"] == kind}


def test_an_exit_before_the_hello_forms_generation_0_with_the_others_at_once():
    proto = ProtocolStateMachine(4, 8, 2, join_timeout=30.0, now=0.0, startup_timeout=120.0)
    out = []
    for r in (0, 1, 3):
        out += proto.on_hello(r, {"tokens_per_mb": 1}, 10.0 + r)
    assert proto.state == "forming" and not _sends(out, "gen")  # replica 2 is still expected
    # each hello is answered with what is left of the start-up deadline, and the count so far
    answers = _sends(out, "startup")
    assert {r: (a["wait"], a["connected"], a["of"]) for r, a in answers.items()} == {
        0: (110.0, 1, 4), 1: (109.0, 2, 4), 3: (107.0, 3, 4)}
    out = proto.on_exit(2, "killed by SIGKILL", 14.0)  # long before the deadline
    gens = _sends(out, "gen")
    assert sorted(gens) == [0, 1, 3] and proto.gen == 0 and proto.members == [0, 1, 3]
    assert sorted(i for g in gens.values() for i in idranges.to_ids(g["quota"])) == iteration_ids(0, 8)
    events = [a for a in out if a.kind == "event"]
    assert events[0].msg["exited"] == 2 and "replica 2 exited during start-up (killed by SIGKILL)" in events[0].reason
    assert "replicas connected 3/3" in events[0].reason
    assert events[1].msg["missing"] == [2] and "generation 0 formed with 3/4" in events[1].reason
    assert proto.pending[-1]["fault"] == "replica 2 exited during start-up (killed by SIGKILL)"
    # a hello from the dead process's replica id is refused, never admitted
    assert [a.kind for a in proto.on_hello(2, {"tokens_per_mb": 1}, 15.0)] == ["close"]


def test_an_exit_notice_for_a_connected_replica_is_left_to_its_connection():
    proto = ProtocolStateMachine(2, 4, 1, join_timeout=30.0, now=0.0)
    proto.on_hello(0, {"tokens_per_mb": 1}, 1.0)
    assert proto.on_exit(0, "exited with code 1", 2.0) == []  # its closed socket says it (on_lost)
    assert proto.state == "forming" and 0 in proto.alive


def test_every_replica_exiting_during_start_up_ends_the_run_at_once():
    proto = ProtocolStateMachine(2, 4, 1, join_timeout=30.0, now=0.0)
    proto.on_exit(0, "exited with code 1", 1.0)
    out = proto.on_exit(1, "exited with code 1", 1.5)
    assert [a for a in out if a.kind == "finish"][0].reason.startswith("no replica left")


@pytest.mark.procs
def test_a_worker_killed_before_its_hello_does_not_sink_the_job(tmp_path, monkeypatch):
    # a fresh interpreter per worker, so that the kill lands in its `import torch`
    monkeypatch.setenv(env_names.WORKER_START, "spawn")
    r, m, steps = 3, 6, 3
    common = ["--replicas", str(r), "--microbatches", str(m), "--steps", str(steps), "--seed", "5",
              "--heartbeat-timeout", "3", "--collective-timeout", "5", "--no-progress"]
    ref_out = tmp_path / "plain"
    run_recover("train", "--system", "plain", *common, "--out", str(ref_out), check=True)
    reference = [x["loss"] for x in load_run(ref_out)[1]]
    plan = tmp_path / "plan.json"
    # fired by the launcher, by PID, at its first tick after the spawn
    plan.write_text(json.dumps({"faults": [{"kind": "crash", "replica": 1, "at_seconds": 0.0}]}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", *common, "--faults", str(plan), "--out", str(out),
                       timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "logs" / "coordinator.log").read_text()
    fired = read_jsonl(out / "faults.jsonl")
    assert [(f["kind"], f["replica"], f["fired_by"]) for f in fired] == [("crash", 1, "launcher")]
    # the coordinator's record names the exit; it says "during start-up" only for a
    # replica that never said hello
    events = read_jsonl(out / "events.jsonl")
    startup = [e for e in events if e["kind"] == "startup"]
    assert [(e["exited"], e["how"]) for e in startup if "exited" in e] == [(1, "killed by SIGKILL")], events
    assert [(e["members"], e["missing"]) for e in startup if "formed" in e] == [(2, [1])], events
    log = (out / "logs" / "coordinator.log").read_text()
    assert "replica 1 exited during start-up (killed by SIGKILL)" in log and "replicas connected 2/2" in log, log
    _, metrics, summary = load_run(out)
    assert [x["step"] for x in metrics] == list(range(steps))
    assert all(x["members"] == [0, 2] and x["generation"] == 0 for x in metrics)
    for x, ref in zip(metrics, reference):
        assert step_ids(x) == iteration_ids(x["step"], m)
        assert abs(x["loss"] - ref) <= LOSS_RTOL * abs(ref), (x["step"], x["loss"], ref)
    assert summary["status"] == "ok"
    exits = {p["replica"]: p for p in summary["processes"] if p["role"] == "worker"}
    assert exits[1]["how"] == "killed by SIGKILL" and exits[0]["returncode"] == exits[2]["returncode"] == 0
