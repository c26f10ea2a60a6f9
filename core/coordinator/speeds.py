"""The replicas' smoothed speeds (microbatches per second): one array for the run.

Contract:
- `SpeedTable(R, smoothing)` holds one speed per replica 0..R-1, unknown until
  a committed step measured it.
- `measure(seconds)`: one step's reports (replica -> seconds per microbatch) as
  arrays: the replicas that timed a microbatch, their speeds (1 / seconds), and the
  slowest microbatch.
- `update(who, measured)`: a committed step's measurements (replicas, microbatches
  per second): each becomes (1 - smoothing) * old + smoothing * measured, the old
  one taken to be the measurement where no speed was known. The same arithmetic,
  in the same order, as `plain_update` beside it (the tests hold them equal to
  the bit).
- `get(r, default)`, `of(replicas)` (a dict, for the quota policy) and
  `spread(replicas)` (whether all are known, and the lowest and highest) read it.
- `slowest_of(who, measured)`: (the slowest replica, its speed, the fastest speed)
  of one step's measurements; ties go to the lowest replica id. None if empty.
- Why an array: the state machine applies R measurements per committed step, and
  at R = 16,384 that was ~4 ms of dict operations and another ~1 ms to find the
  slowest, of a vote-to-commit budget of 50 ms (`recover bench coordinator`);
  vectorized both are a few hundred microseconds. Nothing here decides anything:
  core/coordinator/protocol.py does, from what these answer.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np


class SpeedTable:
    """Smoothed speeds of replicas 0..R-1, NaN where none is known."""

    def __init__(self, replicas: int, smoothing: float):
        self.smoothing = smoothing
        self._speed = np.full(replicas, np.nan)

    def update(self, who: np.ndarray, measured: np.ndarray) -> None:
        """One committed step's measurements: replicas `who` measured speeds `measured`."""
        if not who.size:
            return
        old = self._speed[who]
        old = np.where(np.isnan(old), measured, old)  # none known: as if it had always been this fast
        a = self.smoothing
        self._speed[who] = (1 - a) * old + a * measured

    def get(self, r: int, default: float | None = None) -> float | None:
        v = self._speed[r]
        return default if np.isnan(v) else float(v)

    def of(self, replicas: Iterable[int]) -> dict[int, float]:
        """replica -> its speed, for those known."""
        return {r: float(v) for r in replicas if not np.isnan(v := self._speed[r])}

    def spread(self, replicas: Iterable[int]) -> tuple[bool, float, float]:
        """(every one of `replicas` has a speed, the lowest known, the highest known); NaN with none."""
        v = self._speed[np.fromiter(replicas, dtype=np.int64)]
        known = v[~np.isnan(v)]
        if not known.size:
            return False, float("nan"), float("nan")
        return bool(known.size == v.size), float(known.min()), float(known.max())


def measure(seconds: Mapping[int, float]) -> tuple[np.ndarray, np.ndarray, float]:
    """One step's reports (replica -> seconds per microbatch): (the replicas that measured a
    time, their speeds 1 / seconds, the slowest microbatch in seconds, 0.0 with none)."""
    n = len(seconds)
    who = np.fromiter(seconds.keys(), dtype=np.int64, count=n)
    s = np.fromiter(seconds.values(), dtype=np.float64, count=n)
    slowest = float(s.max()) if n else 0.0
    timed = s > 0
    return who[timed], 1.0 / s[timed], slowest


def slowest_of(who: np.ndarray, measured: np.ndarray) -> tuple[int, float, float] | None:
    """(the slowest replica, its speed, the fastest speed) of a step's measurements; ties: lowest id."""
    if not who.size:
        return None
    lo = measured.min()
    return int(who[measured == lo].min()), float(lo), float(measured.max())


def plain_update(speeds: dict[int, float], measured: Mapping[int, float], smoothing: float) -> None:
    """The plain version of `SpeedTable.update`, on a dict (the tests compare the two)."""
    for r, m in measured.items():
        speeds[r] = (1 - smoothing) * speeds.get(r, m) + smoothing * m
