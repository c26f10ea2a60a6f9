"""Progress, as the coordinator sees it: a count the training thread advances, carried by the heartbeat.

Contract:
- Liveness and progress are two signals. The heartbeat thread proves the process is
  alive; `tick()`, called by the training thread at each unit of work (an id handed
  out, a microbatch folded, a phase of a pipeline schedule), proves that its work
  moves. The heartbeat carries the count (`hb`'s `p`: core/worker/control.py), so
  progress costs no message of its own and nothing on the training thread but an
  addition.
- `resume()` marks the end of a wait on the coordinator (a gen, go or commit came):
  time spent waiting for the coordinator is not work, so it is never measured as a gap.
- `take_gap()` gives the longest interval between two consecutive ticks (or a resume
  and the next tick) since the last call, and starts over. Each vote reports it
  (`progress_gap`), so the coordinator bounds this replica's silence in progress by
  what this replica itself measured (core/coordinator/readiness.py: a replica slow but
  progressing is never fenced; one whose work stops is).
Thread-safety: only the training thread calls these; the heartbeat thread reads `count`,
one int attribute, under the GIL.
"""
from __future__ import annotations

import time
from typing import Callable


class ProgressMeter:
    """The training thread's unit-of-work count, and the longest gap between units."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.count = 0
        self._clock = clock
        self._last = clock()
        self._gap = 0.0

    def tick(self) -> None:
        """One more unit of work done (the training thread)."""
        now = self._clock()
        if now - self._last > self._gap:
            self._gap = now - self._last
        self._last = now
        self.count += 1

    def resume(self) -> None:
        """A wait on the coordinator ended: the next gap is measured from now."""
        self._last = self._clock()

    def take_gap(self) -> float:
        """The longest gap measured since the last call (seconds); the next one starts from 0."""
        gap, self._gap = self._gap, 0.0
        return gap
