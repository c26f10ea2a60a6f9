"""The launcher's nap (core/launch/exit_wait.py) ends when a watched process exits.

Real processes (`sleep`), killed by their PIDs. The waits are given long ticks (60 s), so
returning at all within the test's timeout is the wake; nothing is asserted on speed but
that a wait which must last its whole tick lasts at least that (a lower bound sleep keeps).
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import time

import pytest

from recover.core.launch.exit_wait import ExitWaiter

LONG = 60.0  # a tick no test outlives: a wait that returns woke on an exit

pytestmark = [pytest.mark.procs, pytest.mark.timeout(30)]


@pytest.fixture
def sleepers():
    started: list[subprocess.Popen] = []

    def start(n: int = 1) -> list[subprocess.Popen]:
        procs = [subprocess.Popen(["sleep", "300"]) for _ in range(n)]
        started.extend(procs)
        return procs

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_killed_process_wakes_the_wait(sleepers):
    a, b = sleepers(2)
    waiter = ExitWaiter()
    os.kill(b.pid, signal.SIGKILL)
    t = time.monotonic()
    waiter.wait([a.pid, b.pid], LONG)
    assert time.monotonic() - t < LONG
    assert b.wait() == -signal.SIGKILL and a.poll() is None
    waiter.close()


def test_an_exit_wakes_one_wait_not_every_later_one(sleepers):
    """A replica of many ranks stays running to the launcher until every rank is reaped: its
    dead rank's PID is still named, and must not make every later nap return at once."""
    a, b = sleepers(2)
    waiter = ExitWaiter()
    os.kill(b.pid, signal.SIGKILL)
    waiter.wait([a.pid, b.pid], LONG)
    b.wait()  # reaped, as ReplicaProcesses.poll does, while its PID is still named
    t = time.monotonic()
    waiter.wait([a.pid, b.pid], 0.2)
    assert time.monotonic() - t >= 0.2
    os.kill(a.pid, signal.SIGKILL)  # the other one still wakes a wait
    waiter.wait([a.pid, b.pid], LONG)
    assert a.wait() == -signal.SIGKILL
    waiter.close()


def test_a_process_that_is_not_its_child_wakes_it():
    """A worker of the fork server is the server's child, not the launcher's."""
    shell = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                           check=True)
    orphan = int(shell.stdout.strip())
    waiter = ExitWaiter()
    try:
        waiter.wait([orphan], 0.01)  # opens its pidfd while it runs
        os.kill(orphan, signal.SIGKILL)
        waiter.wait([orphan], LONG)
    finally:
        try:
            os.kill(orphan, signal.SIGKILL)
        except ProcessLookupError:
            pass
        waiter.close()


def test_a_pid_already_gone_returns_at_once(sleepers):
    (a,) = sleepers(1)
    a.kill()
    a.wait()  # reaped: no process has the PID (unless reused, which only costs a tick)
    ExitWaiter().wait([a.pid], LONG)


def test_without_pidfds_it_sleeps_the_tick(sleepers, monkeypatch):
    (a,) = sleepers(1)

    def refused(pid, flags=0):
        raise OSError(errno.ENOSYS, "no pidfd_open here")

    monkeypatch.setattr(os, "pidfd_open", refused, raising=False)
    waiter = ExitWaiter()
    t = time.monotonic()
    waiter.wait([a.pid], 0.2)
    assert time.monotonic() - t >= 0.2
    assert a.poll() is None
