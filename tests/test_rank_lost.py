"""A replica of many ranks is known lost when a rank other than its leader fails, not when its leader's exit is through.

The launcher kills the other ranks of a replica once one has failed
(core/launch/replica_processes.py). Its leader's control connection then closes only
when the kernel is done tearing that process down, which for a training process comes
tens of milliseconds after the kill, and only after the failed rank's own teardown. So
the launcher tells the coordinator at once ({"t": "rank_lost"}, core/launch/exit_notices.py),
and the state machine treats the replica as its closed connection would
(`ProtocolStateMachine.on_rank_lost`), for the process set whose leader said hello only.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import time

import pytest

from recover.core.components.data import iteration_ids
from recover.core.coordinator.protocol import ProtocolStateMachine
from recover.core.launch.exit_notices import ExitNotices
from recover.core.launch.launcher import Launcher
from recover.core.launch.replica_processes import ReplicaProcesses
from recover.core.storage.results import read_jsonl, read_metrics, reported_ids

from conftest import pid_alive, run_recover_killing

R, M = 3, 6


def _formed() -> ProtocolStateMachine:
    proto = ProtocolStateMachine(R, M, 4, join_timeout=1e9, now=0.0)
    for r in range(R):
        proto.on_hello(r, {"tokens_per_mb": 1, "pid": 100 + r}, 0.0)
    assert proto.gen == 0 and proto.members == [0, 1, 2] and proto.state == "running"
    return proto


def test_a_lost_rank_of_the_process_set_that_said_hello_takes_its_replica_out_at_once():
    proto = _formed()
    outs = proto.on_rank_lost(1, 1, 101, "killed by SIGKILL", 0.5)
    assert [a.replica for a in outs if a.kind == "close"] == [1]
    aborts = [a for a in outs if a.kind == "send" and a.msg["t"] == "abort"]
    assert sorted(a.replica for a in aborts) == [0, 2] and all(a.msg["step"] == 0 for a in aborts), outs
    assert 1 in proto.dead and 1 not in proto.alive
    assert proto.pending[-1]["faults"] == ["replica 1 lost: its rank 1 failed (killed by SIGKILL); the launcher "
                                           "stops the replica's other ranks"]
    # its connection closing afterwards is no news
    assert proto.on_lost(1, "control connection closed (process gone)", 0.6) == []


def test_news_of_another_process_set_or_of_a_replica_not_alive_changes_nothing():
    proto = _formed()
    assert proto.on_rank_lost(1, 1, 999, "killed by SIGKILL", 0.5) == []  # an earlier set's leader
    assert proto.on_rank_lost(7, 1, 107, "killed by SIGKILL", 0.5) == []  # no such replica
    assert proto.members == [0, 1, 2] and not proto.dead
    proto.on_lost(2, "control connection closed (process gone)", 0.5)
    assert proto.on_rank_lost(2, 1, 102, "killed by SIGKILL", 0.6) == []


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_the_launcher_tells_the_coordinator_before_it_kills_the_others_and_not_for_a_leader(tmp_path):
    """Real processes (`sleep`), killed by PID; the coordinator's end is a listening socket read here."""
    server = socket.create_server(("127.0.0.1", 0))
    procs: list[subprocess.Popen] = []
    try:
        launcher = Launcher(tmp_path, ["true"], lambda r: ["true"], 2)
        launcher._notices = ExitNotices("127.0.0.1", server.getsockname()[1], "token")
        conn, _ = server.accept()
        conn.settimeout(10)
        lines = conn.makefile("r")
        assert json.loads(lines.readline()) == {"t": "launcher", "token": "token"}
        alive_when_told: list[bool] = []

        def start(r: int) -> ReplicaProcesses:
            ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
            procs.extend(ranks)

            def told(p: ReplicaProcesses) -> None:
                others = [q for k, q in enumerate(p.procs) if k != p.failed_rank]
                alive_when_told.append(all(pid_alive(q.pid) for q in others))
                launcher._tell_rank_lost(r, p)
            return ReplicaProcesses(ranks, on_rank_failed=told)

        replicas = {r: start(r) for r in (0, 1)}
        replicas[1].procs[1].send_signal(signal.SIGKILL)  # a follower's rank
        replicas[0].procs[0].send_signal(signal.SIGKILL)  # a leader: its own connection says it
        end = time.monotonic() + 20
        while any(rp.poll() is None for rp in replicas.values()):
            assert time.monotonic() < end, "the replicas did not end"
            time.sleep(0.01)
        assert json.loads(lines.readline()) == {"t": "rank_lost", "replica": 1, "rank": 1,
                                                "pid": replicas[1].pid, "how": "killed by SIGKILL"}
        assert alive_when_told == [True, True]  # both seen before the kill (only the follower's is sent)
        launcher._notices.close()
        assert lines.read() == ""  # once: nothing for the replica whose leader died
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        server.close()



@pytest.mark.procs
@pytest.mark.timeout(240)
def test_a_follower_killed_while_its_leader_is_frozen_is_a_lost_replica_on_the_launchers_word(tmp_path):
    """`recover train` at 3 x S2: replica 1's leader SIGSTOPped by its PID (it can neither notice
    nor exit), then its rank 1 SIGKILLed by its PID. Only the launcher's word can tell the
    coordinator before the leader's own death; the survivors redo the lost ids."""
    out = tmp_path / "run"
    steps = 6
    plan = tmp_path / "plan.json"  # paced, so the run outlasts the kill on a quiet machine
    plan.write_text(json.dumps({"faults": [{"kind": "pace", "replica": r, "step": 0, "phase": "forward",
                                            "seconds": 0.1} for r in range(R)]}))
    args = ["train", "--system", "recover", "--replicas", str(R), "--shard", "2", "--microbatches", str(M),
            "--steps", str(steps), "--faults", str(plan), "--no-progress", "--out", str(out)]
    proc, _ = run_recover_killing(args, out, replica=1, after_commits=2, rank=1, stop_first=(0,), timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(reported_ids(m) == iteration_ids(m["step"], M) for m in metrics)  # the ledgers, each id once
    assert metrics[-1]["members"] == [0, 2]
    [rec] = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "recovery"]
    assert rec["faults"] == ["replica 1 lost: its rank 1 failed (killed by SIGKILL); the launcher stops the "
                             "replica's other ranks"], rec
    assert rec["survivors"] == [0, 2] and rec["redone"]
