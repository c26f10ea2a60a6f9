"""When quotas follow the measured speeds (balancing), for the protocol state machine.

Contract:
- Each committed step's measured speeds (core/coordinator/speeds.py `measure`) update
  each replica's smoothed speed; step 0 pays one-time costs and is no measurement (the
  machine passes it empty: it neither extends nor ends a streak).
- Quotas stay equal (the machine deals one message for all) until one member has been
  the slowest, by more than SPEED_TOLERANCE, in SPEED_WINDOW consecutive committed steps
  (`slow_streak`): a sustained difference, not a noisy step. A streak holder that folded
  nothing in a step (the policy gave it none) keeps its streak: no new evidence.
- Once started, balancing goes on until the smoothed speeds of the members are within
  the tolerance again (hysteresis): one noisy step does not undo it.
- While balancing, `speeds_for` gives the members' speeds for the quota policy
  (core/contract/policy.py); otherwise None (equal shares). O(1) when not balancing.

A state object, not a mixin: everything it decides is a function of its own state (the
speed table, the streak, the flag) and of the members the machine passes in, so the
machine (`ProtocolStateMachine.balancer`) calls it and it calls nothing back. The speed
table is the machine's too (`ProtocolStateMachine.speeds`: admission picks the donor by
it), handed to the balancer, which alone updates it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recover.core.coordinator.speeds import SpeedTable, slowest_of

SPEED_SMOOTHING = 0.2  # weight of the newest measurement in a replica's speed estimate
SPEED_TOLERANCE = 0.5  # speeds within 50% of each other are balanced as equal
# A replica counts as slow only after it was the slowest, by more than the tolerance,
# in this many consecutive committed steps: on a loaded machine one or two noisy
# steps often read 2x apart, and a quota moved by noise would also move the
# microbatches a fault plan names (a plan's "microbatch k" must exist to fire).
SPEED_WINDOW = 4


@dataclass(slots=True)
class Balancing:
    """The replicas' smoothed speeds and whether quotas follow them."""

    speeds: SpeedTable  # smoothed microbatches/s, per replica
    slow_streak: dict[int, int] = field(default_factory=dict)  # replica -> consecutive steps it was measured slowest
    balancing: bool = False  # quotas follow the speeds: set by a sustained difference, kept until it ends

    @classmethod
    def of(cls, replicas: int) -> Balancing:
        """A balancer with a table of its own (the machine passes its table instead)."""
        return cls(SpeedTable(replicas, SPEED_SMOOTHING))

    def speeds_for(self, members: list[int]) -> dict[int, float] | None:
        """The members' speeds for the quota policy, or None (equal) while they are close.

        Measured speeds carry scheduling noise (seen here: 2x swings between equal
        replicas on a loaded machine); an uneven split only pays off when a replica
        is really slower, so speeds within SPEED_TOLERANCE of each other count as equal,
        and so do any speeds until one member has been the slowest beyond that tolerance
        in SPEED_WINDOW consecutive steps (a sustained difference, not noise). Once
        started, balancing goes on until the smoothed speeds are within the tolerance
        again (`_update`): one noisy step does not undo it.
        """
        if not self.balancing:  # first: the common case costs O(1), not a pass over the members
            return None
        known_all, lo, hi = self.speeds.spread(members)
        if not known_all or hi <= (1 + SPEED_TOLERANCE) * lo:
            return None
        return self.speeds.of(members)

    def after_commit(self, who: Any, measured: Any, members: list[int], member_set: set[int]) -> None:
        """One committed step's measurements (`who`, `measured`: core.coordinator.speeds.measure's
        arrays, empty for step 0): smooth them in, extend or end the slow streak, start or stop balancing."""
        self.speeds.update(who, measured)  # smoothed: one noisy step must not reshuffle quotas
        self._count_slow_streak(who, measured, member_set)
        self._update(members, member_set)

    def _update(self, members: list[int], member_set: set[int]) -> None:
        """After a commit: start balancing on a sustained difference, stop when the
        smoothed speeds come back within the tolerance.

        The window is needed to start, not to keep going: beside `stress-ng` one noisy
        step in which a fast replica read slowest ended a 4x straggler's streak, and its
        quota went back to equal for the next several steps (seen: steps 6-9 balanced,
        10-16 equal again). Hysteresis keeps the decision until the speeds themselves,
        smoothed, say the straggler caught up."""
        # slow_streak names at most one replica: this is O(1)
        streak = max((n for r, n in self.slow_streak.items() if r in member_set), default=0)
        if not self.balancing and streak < SPEED_WINDOW:
            return  # not balancing and no reason to start: the pass over the speeds below could only say so
        known_all, lo, hi = self.speeds.spread(members)
        if not known_all or hi <= (1 + SPEED_TOLERANCE) * lo:
            self.balancing = False
        elif streak >= SPEED_WINDOW:
            self.balancing = True

    def _count_slow_streak(self, who: Any, measured: Any, member_set: set[int]) -> None:
        """One committed step's speeds: extend the slowest member's streak if it was
        slower than the fastest by more than SPEED_TOLERANCE; every other streak ends.
        A streak holder that folded nothing this step keeps its streak: otherwise a
        straggler given no work would read as cured and get its full quota back."""
        # (slow_streak names at most one replica)
        if any(r in member_set and not (who == r).any() for r in self.slow_streak):
            return  # the slow one folded nothing this step (the policy gave it none): no new evidence
        slow = None
        if who.size >= 2:
            r, low, high = slowest_of(who, measured)  # ties: the lowest id
            if high > (1 + SPEED_TOLERANCE) * low:
                slow = r
        if who.size:  # a step without measurements (step 0) neither extends nor ends a streak
            self.slow_streak = {slow: self.slow_streak.get(slow, 0) + 1} if slow is not None else {}
