"""A process that ends while a daemon thread is inside the backend ends cleanly (core/worker/backend_threads.py).

A real process (tests/buried_comm_at_exit.py) ends its main module while its graveyard's
reaper is destroying a gloo communicator with a broadcast in flight, and the interpreter
is still finalizing when that destructor returns. With backend_threads' atexit wait it
exits 0 after the destructor returned; without it (the same script, the wait
unregistered), the reaper is ended inside C++ and the process dies of SIGABRT with
"terminate called without an active exception", which is how a user's loop died in CI
after its run had completed. And, as pure logic: a listed call is waited for until it
leaves, and no longer than its deadline.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from recover.core.worker import backend_threads

SCRIPT = str(Path(__file__).resolve().parent / "buried_comm_at_exit.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.procs
def test_the_exit_waits_for_the_graveyard_and_without_the_wait_the_process_aborts():
    p = _run()
    assert p.returncode == 0 and "main module done" in p.stdout, (p.returncode, p.stdout, p.stderr)
    assert "terminate called" not in p.stderr, p.stderr
    # the hazard the wait removes is real: the same exit, unwaited, aborts
    p = _run("unlisted")
    assert p.returncode == -signal.SIGABRT, (p.returncode, p.stdout, p.stderr)
    assert "terminate called without an active exception" in p.stderr, p.stderr


def test_wait_returns_when_the_call_leaves_and_gives_up_at_its_deadline():
    key = backend_threads.enter("a call that leaves", time.monotonic() + 30)
    threading.Timer(0.2, backend_threads.leave, args=(key,)).start()
    assert backend_threads.wait() == []  # returned when it left, not at its 30 s deadline
    with backend_threads.inside("a call that stays", time.monotonic() + 0.2):
        assert backend_threads.wait() == ["a call that stays"]
    assert backend_threads.listed() == []
