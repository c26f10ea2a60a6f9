"""A worker waits for its coordinator as long as the coordinator beats, not a fixed time.

A generation can form around a member that finishes a long pipeline schedule first (the
progress rule waits for it), so the survivors' wait for `gen` has no fixed bound that slow
work could not outgrow. The wait ends on the coordinator's silence (judged by the control
client from its heartbeats), or, for a coordinator that never beat, on the old backstop.
Pure: a bare Replica and a fake control client.
"""
from __future__ import annotations

import collections

import pytest

from recover.core.contract.worker_exit import EXIT_COORDINATOR_GONE
from recover.core.worker.replica import Replica, RunEnded

GEN = {"t": "gen", "gen": 1, "step": 4}


class _Control:
    def __init__(self, msgs, beats: bool):
        self.msgs = collections.deque(msgs)
        self.coordinator_beats = beats
        self.waited: list[float | None] = []

    def recv(self, timeout):
        self.waited.append(timeout)
        return self.msgs.popleft()


def _replica(control) -> Replica:
    r = object.__new__(Replica)
    r.timeout, r.control, r.generation = 1.0, control, 0
    return r


def test_a_beating_coordinator_is_waited_for_past_the_backstop():
    control = _Control([None, None, None, GEN], beats=True)  # three backstops pass without an answer
    assert _replica(control)._wait_for_inner({"gen"}, 1, False) == GEN
    assert len(control.waited) == 4


def test_a_coordinator_that_never_beat_is_given_up_at_the_backstop():
    control = _Control([None, GEN], beats=False)
    with pytest.raises(RunEnded) as e:
        _replica(control)._wait_for_inner({"gen"}, 1, False)
    assert e.value.code == EXIT_COORDINATOR_GONE
