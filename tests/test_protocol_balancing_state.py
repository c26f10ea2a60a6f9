"""core/coordinator/balancing.py's `Balancing` on its own: when quotas follow the measured speeds.

The machine-level behaviour (a straggler's quota shrinks, noise leaves quotas equal) is in
tests/test_protocol_balancing.py; here the state object is fed one step's measurements at a
time (core.coordinator.speeds.measure's arrays, from seconds per microbatch):
- balancing starts only after SPEED_WINDOW consecutive steps with the same member slowest
  beyond the tolerance, and then the policy gets every member's speed;
- once started, one noisy step (a streak ended) does not stop it; smoothed speeds back
  within the tolerance do;
- a streak holder that folded nothing keeps its streak, and step 0 (no measurement) is no step;
- the machine's `slow_streak`, `balancing` and `balancing_speeds` show this state.
Pure: no processes.
"""
from __future__ import annotations

from recover.core.coordinator import protocol
from recover.core.coordinator.balancing import SPEED_WINDOW, Balancing
from recover.core.coordinator.protocol import ProtocolStateMachine
from recover.core.coordinator.speeds import measure

MEMBERS = [0, 1, 2]


def step(b: Balancing, seconds: dict[int, float]) -> None:
    who, measured, _ = measure(seconds)
    b.after_commit(who, measured, MEMBERS, set(MEMBERS))


def test_a_sustained_straggler_starts_balancing_and_noise_does_not_stop_it():
    b = Balancing.of(3)
    slow = {0: 0.01, 1: 0.01, 2: 0.04}  # replica 2 folds a microbatch 4x slower
    for n in range(1, SPEED_WINDOW):
        step(b, slow)
        assert b.slow_streak == {2: n} and not b.balancing and b.speeds_for(MEMBERS) is None
    step(b, slow)
    assert b.slow_streak == {2: SPEED_WINDOW} and b.balancing
    speeds = b.speeds_for(MEMBERS)
    assert set(speeds) == set(MEMBERS) and speeds[2] < speeds[0] / 2
    step(b, {0: 0.04, 1: 0.01, 2: 0.04})  # one noisy step: replica 0 reads slowest (tie: the lowest id)
    assert b.slow_streak == {0: 1} and b.balancing  # the streak moved, the decision stays
    for _ in range(30):  # the straggler caught up: its smoothed speed comes back within the tolerance
        step(b, {0: 0.01, 1: 0.01, 2: 0.01})
    assert not b.balancing and b.speeds_for(MEMBERS) is None and b.slow_streak == {}


def test_no_work_or_no_measurement_is_no_evidence():
    b = Balancing.of(3)
    step(b, {0: 0.01, 1: 0.01, 2: 0.04})
    assert b.slow_streak == {2: 1}
    step(b, {0: 0.01, 1: 0.01})  # replica 2 was given nothing this step: it keeps its streak
    assert b.slow_streak == {2: 1}
    step(b, {})  # step 0's measurements are left out: neither extends nor ends a streak
    assert b.slow_streak == {2: 1}
    step(b, {0: 0.01, 1: 0.011, 2: 0.012})  # all within the tolerance: the streak ends
    assert b.slow_streak == {} and not b.balancing


def test_the_machine_shows_the_state_under_its_old_names():
    assert protocol.SPEED_WINDOW == SPEED_WINDOW
    proto = ProtocolStateMachine(3, 6, 2, join_timeout=30.0, now=0.0)
    assert proto.slow_streak == {} and not proto.balancing and proto.balancing_speeds() is None
    proto.balancer.slow_streak[1] = 2
    proto.balancer.balancing = True
    assert proto.slow_streak == {1: 2} and proto.balancing
