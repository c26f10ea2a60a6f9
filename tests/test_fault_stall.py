"""A `stall` without `seconds` stalls for good: the training thread blocks, the process lives.

`time.sleep(float("inf"))` raised OverflowError at once, so such a fault killed the rank
(a crash, not a hang) and every "stalled for good" check tested a crash. Pure: a thread.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from recover.fault_injection.kinds import _stall, sleep_for_good


def test_a_stall_without_seconds_blocks_and_does_not_raise():
    errors: list[BaseException] = []

    def target():
        try:
            _stall(SimpleNamespace(), 0, SimpleNamespace(seconds=None), 3)
        except BaseException as e:  # noqa: BLE001 - the test reports whatever ended it
            errors.append(e)

    t = threading.Thread(target=target, daemon=True)  # blocked for good: the daemon dies with pytest
    t.start()
    t.join(0.5)
    assert not errors, errors
    assert t.is_alive()


def test_sleeping_for_good_never_returns_of_itself():
    calls = []

    def sleep(s):
        calls.append(s)
        if len(calls) == 5:
            raise StopIteration  # the only way out: the process (here, the fake) ends it

    with pytest.raises(StopIteration):
        sleep_for_good(sleep)
    assert calls == [3600.0] * 5


def test_a_stall_with_seconds_returns():
    _stall(SimpleNamespace(), 0, SimpleNamespace(seconds=0.01), 3)
