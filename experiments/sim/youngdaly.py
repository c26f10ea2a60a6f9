"""Optimal checkpoint intervals: Young's first-order formula and Daly's higher-order one.

Contract: with delta the time a checkpoint takes and M the mean time between failures
of the whole job (both in seconds), the compute time between checkpoints that
minimises the expected wall time is approximately
    Young (1974):  tau = sqrt(2 * delta * M)
    Daly (2006):   tau = sqrt(2 * delta * M) * (1 + sqrt(delta / (2 M)) / 3 + delta / (18 M)) - delta
                   for delta < 2 M, and tau = M otherwise.
Both assume failures form a Poisson process and every failure costs a restart plus the
work since the last checkpoint, which is the ckpt-restart policy's model. The
simulator checkpoints every K whole iterations, so the interval is rounded to the
nearest whole number of iterations (at least 1): `interval_iterations`.
"""
from __future__ import annotations

import math


def young_interval(delta: float, mtbf: float) -> float:
    """Young's optimal compute seconds between checkpoints."""
    if delta <= 0:
        raise ValueError("checkpoint time must be > 0")
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimal compute seconds between checkpoints."""
    if delta <= 0:
        raise ValueError("checkpoint time must be > 0")
    if math.isinf(mtbf):
        return math.inf
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def interval_iterations(interval_seconds: float, iteration_seconds: float, cap: int = 10**9) -> int:
    """The whole number of iterations closest to `interval_seconds` (>= 1, <= cap)."""
    if math.isinf(interval_seconds):
        return cap
    return max(1, min(cap, int(round(interval_seconds / iteration_seconds))))
