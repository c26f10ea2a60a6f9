"""The launcher's end-of-job policies: pure decisions, then the real launcher with stand-in processes.

The stand-ins are plain `python -c` processes (no torch), so each launch costs a
fraction of a second; what they prove is the launcher's loop: reaping, the
policy's verdict, the grace period, and that every process it started is gone.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from recover.baselines.supervise import UntilWorkersExit
from recover.core.launch.end_policy import CoordinatorEnds, EndVerdict, FailFast, JobView
from recover.core.launch.launcher import Launcher, ProcessExit

pytestmark = pytest.mark.timeout(60)


def _exit(role: str, replica: int, code: int) -> ProcessExit:
    how = "exited 0" if code == 0 else (f"killed by signal {-code}" if code < 0 else f"exited with code {code}")
    return ProcessExit(role, replica, 1000 + replica, code, 0.0, how)


class _Running:
    """Stands for a live Popen in a JobView (only .pid is read, by UntilWorkersExit)."""

    pid = os.getpid()  # this test process: running, never stopped


def test_coordinator_ends_waits_for_the_coordinator_and_takes_its_code():
    policy = CoordinatorEnds()
    assert policy.decide(JobView({0: _Running()}, (_exit("worker", 1, -9),))) is None
    v = policy.decide(JobView({0: _Running()}, (_exit("worker", 1, -9), _exit("coordinator", -1, 1))))
    assert v == EndVerdict(1, "coordinator exited with code 1", wait_for_workers=True)
    assert policy.decide(JobView({}, (_exit("coordinator", -1, 0),))) == EndVerdict(0, "", True)


def test_fail_fast_ends_at_the_first_failing_worker_and_succeeds_when_all_finished():
    policy = FailFast()
    assert policy.decide(JobView({0: _Running(), 1: _Running()}, ())) is None
    assert policy.decide(JobView({1: _Running()}, (_exit("worker", 0, 0),))) is None
    v = policy.decide(JobView({1: _Running()}, (_exit("worker", 0, 0), _exit("worker", 2, -9), _exit("worker", 3, 1))))
    assert v is not None and v.returncode == 1 and v.reason.startswith("replica 2 (pid 1002) killed")
    assert policy.decide(JobView({}, (_exit("worker", 0, 0), _exit("worker", 1, 0)))) == EndVerdict(0)


def test_until_workers_exit_ignores_the_coordinator_and_judges_by_the_workers():
    policy = UntilWorkersExit()
    assert policy.decide(JobView({0: _Running()}, (_exit("coordinator", -1, 0),))) is None
    assert policy.decide(JobView({0: _Running()}, (_exit("worker", 1, -9),))) is None  # one survivor runs on
    assert policy.decide(JobView({}, (_exit("worker", 1, -9), _exit("worker", 0, 0)))) == EndVerdict(0)
    v = policy.decide(JobView({}, (_exit("worker", 0, -9), _exit("worker", 1, 1))))
    assert v == EndVerdict(1, "no replica finished (last: replica 1 exited with code 1)")


# ---- the real launcher ------------------------------------------------------------------
# A stand-in coordinator: announce the ports line, then live for `life` seconds and exit `code`.
_COORDINATOR = (
    "import json, sys, time; print(json.dumps({'host': '127.0.0.1', 'store_port': 1}), flush=True); "
    "time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"
)
_WORKER = "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"


def _launch(tmp_path, coordinator: tuple[float, int], workers: dict[int, tuple[float, int]], **kw):
    launcher = Launcher(
        tmp_path,
        [sys.executable, "-c", _COORDINATOR, *map(str, coordinator)],
        lambda r: [sys.executable, "-c", _WORKER, *map(str, workers[r])],
        sorted(workers),
        grace_seconds=kw.pop("grace_seconds", 5.0),
        **kw,
    )
    result = launcher.run()
    procs = [launcher.coordinator, *launcher.workers.values()]
    return result, procs


def _all_gone(procs: list[subprocess.Popen]) -> bool:
    return all(p.poll() is not None for p in procs)


@pytest.mark.procs
def test_the_default_job_ends_with_its_coordinator_after_the_workers_grace(tmp_path):
    # Replica 0 exits 0 before the coordinator, replica 1 within the grace period after it.
    result, procs = _launch(tmp_path, (1.0, 0), {0: (0.2, 0), 1: (1.5, 0)})
    assert result.returncode == 0, result
    assert [(e.role, e.replica, e.returncode) for e in result.exits] == [
        ("worker", 0, 0), ("coordinator", -1, 0), ("worker", 1, 0)]
    assert _all_gone(procs)


@pytest.mark.procs
def test_fail_fast_stops_the_job_at_the_first_failure_and_kills_the_rest(tmp_path):
    result, procs = _launch(tmp_path, (60.0, 0), {0: (0.3, 7), 1: (60.0, 0)}, end=FailFast())
    assert result.returncode == 1 and result.reason.startswith("replica 0 ") and "code 7" in result.reason
    assert _all_gone(procs)
    # The 60 s processes did not run to their end: the cleanup killed them.
    assert {e.replica for e in result.exits if e.returncode not in (0, 7)} == {-1, 1}


@pytest.mark.procs
def test_until_workers_exit_outlives_a_dead_coordinator(tmp_path):
    result, procs = _launch(tmp_path, (0.1, 1), {0: (0.3, 1), 1: (1.0, 0)}, end=UntilWorkersExit())
    assert result.returncode == 0, result
    roles = [(e.role, e.replica) for e in result.exits]
    assert roles.index(("coordinator", -1)) < roles.index(("worker", 1))
    assert _all_gone(procs)


class _Gone:
    """A process already reaped: its pid and how it ended (pure: no process behind it)."""

    def __init__(self, pid: int, returncode: int | None):
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int | None:
        return self.returncode


def test_a_kill_and_the_failure_it_caused_seen_in_one_look_record_the_kill_first(tmp_path):
    # replica 1 SIGKILLed; replica 0's collective failed on it (exit 1); both gone by one tick
    launcher = Launcher(tmp_path, ["coordinator"], lambda r: ["worker", str(r)], 3)
    launcher.coordinator = _Gone(100, None)
    live = {0: _Gone(10, 1), 1: _Gone(11, -signal.SIGKILL), 2: _Gone(12, None)}
    launcher._reap(live, 0.0)
    assert [(e.replica, e.how) for e in launcher.exits] == [(1, "killed by SIGKILL"), (0, "exited with code 1")]
    assert list(live) == [2]


def test_a_crash_looping_slot_waits_twice_as_long_each_time():
    from recover.core.launch.launcher import replacement_delay

    assert [replacement_delay(0.5, k) for k in range(4)] == [0.5, 1.0, 2.0, 4.0]


@pytest.mark.procs
def test_replacements_that_die_at_once_are_capped(tmp_path, capfd):
    from recover.core.launch.launcher import MAX_QUICK_DEATHS

    # Replica 1 and every replacement of it exit 1 at once; the coordinator outlives the
    # capped sequence (0.05 s x (1 + 2 + 4 + 8 + 16) of waits, well under its life), then ends the job.
    result, procs = _launch(tmp_path, (8.0, 0), {0: (7.5, 0), 1: (0.0, 1)}, replace_after=0.05)
    assert result.returncode == 0, result
    ones = [e for e in result.exits if e.role == "worker" and e.replica == 1]
    assert len(ones) == 1 + MAX_QUICK_DEATHS and all(e.returncode == 1 for e in ones)
    assert len({e.pid for e in ones}) == len(ones)  # a new process each time
    assert "replica 1: not replaced again" in capfd.readouterr().err
    assert _all_gone(procs)


# A stand-in coordinator that takes the launcher's connection and, ending, names its members.
_NAMING_COORDINATOR = """
import json, socket, sys, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(json.dumps({"host": "127.0.0.1", "store_port": 1, "control_port": srv.getsockname()[1],
                  "accepts_exits": True}), flush=True)
conn, _ = srv.accept()
time.sleep(float(sys.argv[1]))
conn.sendall((json.dumps({"t": "ended", "members": json.loads(sys.argv[2])}) + "\\n").encode())
sys.exit(0)
"""


@pytest.mark.procs
def test_the_launcher_waits_for_the_members_the_coordinator_names_and_stops_the_others(tmp_path, capfd):
    # Replica 1 is no member at the end (a replica fenced for a stall that never ends): it
    # would exit 0 by itself within the grace, but it is stopped at once; member 0 exits on its own.
    workers = {0: (1.5, 0), 1: (20.0, 0)}
    launcher = Launcher(
        tmp_path,
        [sys.executable, "-c", _NAMING_COORDINATOR, "0.5", "[0]"],
        lambda r: [sys.executable, "-c", _WORKER, *map(str, workers[r])],
        sorted(workers),
        grace_seconds=30.0,
    )
    result = launcher.run()
    assert result.returncode == 0, result
    how = {e.replica: e.returncode for e in result.exits}
    assert how == {-1: 0, 0: 0, 1: -signal.SIGTERM}, result.exits
    assert "without replica(s) [1] as members: stopping their processes" in capfd.readouterr().err
    assert _all_gone([launcher.coordinator, *launcher.workers.values()])


def test_the_members_named_at_the_end_are_read_from_lines_in_pieces():
    import socket
    import time

    from recover.core.launch.exit_notices import ExitNotices

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    notices = ExitNotices("127.0.0.1", srv.getsockname()[1], "token")
    conn, _ = srv.accept()
    try:
        assert notices.members_at_end() is None
        conn.sendall(b'{"t":"hb"}\n{"t":"ended","memb')
        assert notices.members_at_end() is None  # half a line names nobody yet
        conn.sendall(b'ers":[0,2]}\n')
        conn.close()
        for _ in range(100):  # the bytes cross a local socket: read until they are in
            if notices.members_at_end() is not None:
                break
            time.sleep(0.01)
        assert notices.members_at_end() == [0, 2]
    finally:
        notices.close()
        srv.close()
