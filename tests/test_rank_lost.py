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

from recover.core.coordinator.protocol import ProtocolStateMachine
from recover.core.launch.exit_notices import ExitNotices
from recover.core.launch.launcher import Launcher
from recover.core.launch.replica_processes import ReplicaProcesses

from conftest import run_recover  # noqa: F401 - the suite's helpers (sys.path)

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
def test_the_launcher_tells_the_coordinator_when_a_followers_rank_fails_and_not_for_a_leaders(tmp_path):
    """Real processes (`sleep`), killed by PID; the coordinator's end is a listening socket read here."""
    server = socket.create_server(("127.0.0.1", 0))
    procs: list[subprocess.Popen] = []
    try:
        launcher = Launcher(tmp_path, ["true"], lambda r: ["true"], 2)
        launcher.coordinator = subprocess.Popen(["sleep", "60"])
        procs.append(launcher.coordinator)
        launcher._notices = ExitNotices("127.0.0.1", server.getsockname()[1], "token")
        conn, _ = server.accept()
        conn.settimeout(10)
        lines = conn.makefile("r")
        assert json.loads(lines.readline()) == {"t": "launcher", "token": "token"}
        replicas = {r: ReplicaProcesses([subprocess.Popen(["sleep", "60"]) for _ in range(2)]) for r in (0, 1)}
        procs += [p for rp in replicas.values() for p in rp.procs]
        live = dict(replicas)
        replicas[1].procs[1].send_signal(signal.SIGKILL)  # a follower's rank
        replicas[0].procs[0].send_signal(signal.SIGKILL)  # a leader: its own connection says it
        end = time.monotonic() + 20
        while any(rp.procs[k].poll() is None for rp, k in ((replicas[1], 1), (replicas[0], 0))):
            assert time.monotonic() < end, "the killed ranks were not reaped"
            time.sleep(0.01)
        launcher._reap(live, time.monotonic())
        assert json.loads(lines.readline()) == {"t": "rank_lost", "replica": 1, "rank": 1,
                                                "pid": replicas[1].pid, "how": "killed by SIGKILL"}
        launcher._reap(live, time.monotonic())  # told once per process set
        while live:
            assert time.monotonic() < end, "the replicas did not end"
            launcher._reap(live, time.monotonic())
            time.sleep(0.01)
        launcher._notices.close()
        told = [json.loads(line) for line in lines]
        assert sorted((m["t"], m["replica"]) for m in told) == [("exited", 0), ("exited", 1)], told
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        server.close()
