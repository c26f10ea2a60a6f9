"""A replica whose first connection closed before the coordinator read its hello goes on starting.

Under a flood of connections without a hello the coordinator closes the oldest one
(core/coordinator/service.py); a worker slowed by load can send its hello after 256 strangers
have arrived, and its connection is that oldest one. The worker reconnects with a report, and
a coordinator still in start-up answers "startup": its hello counted the replica in. Seen twice
in full suites (tests/test_control_plane_attack.py, the tokenless flood): the worker took that
answer for a fence and exited 3, and generation 0 formed without it. That flood test is the
evidence with real processes; here, as pure logic, the decision on the answer: a replica in no
generation waits on with the answer put back, one that was a member is still fenced.
The Replica is built without processes: only what `_terminal` reads is set.
"""
from __future__ import annotations

import collections

import pytest

from recover.core.worker.replica import Replica, RunEnded

STARTUP = {"t": "startup", "wait": 290.0, "connected": 2, "of": 3}


class _Control:
    def __init__(self):
        self.pending = collections.deque()

    def put_back(self, msg):
        self.pending.appendleft(msg)


def _replica(generation: int) -> Replica:
    r = object.__new__(Replica)
    r.generation, r.step, r.rejoin, r.reconnect_timeout = generation, 0, True, 60.0
    r.control = _Control()

    def reconnect():  # what `_reconnect` does: a new connection, its hello answered
        r.control = _Control()
        return dict(STARTUP)

    r._reconnect = reconnect
    return r


def test_a_startup_answer_to_a_reconnect_before_any_generation_is_waited_on():
    r = _replica(generation=-1)
    assert r._terminal({"t": "closed"}) is True  # the wait goes on
    assert list(r.control.pending) == [STARTUP]  # on the new connection, with the answer to read


def test_a_startup_answer_to_a_members_reconnect_is_still_a_fence():
    r = _replica(generation=0)
    with pytest.raises(RunEnded, match="answered the reconnect with 'startup'"):
        r._terminal({"t": "closed"})
